"""Typed FastAPI dependencies of the replica's routes: the app's `Replica` and its `OpenStreams`
(both on `app.state`, set by app/replica/server.py `create_app`).

    @router.get("/v1/status")
    async def status(replica: ReplicaDep) -> dict[str, Any]: ...
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.replica.openai.stream import OpenStreams
from app.replica.replica import Replica


async def get_replica(request: Request) -> Replica:
    # async: FastAPI runs sync dependencies in a thread pool, a thread hop per request
    return request.app.state.replica


async def get_open_streams(request: Request) -> OpenStreams:
    return request.app.state.streams


ReplicaDep = Annotated[Replica, Depends(get_replica)]
OpenStreamsDep = Annotated[OpenStreams, Depends(get_open_streams)]
