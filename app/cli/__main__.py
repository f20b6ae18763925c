"""`python -m app.cli ...`: the same as the `flywheel` console script (app.cli:main)."""

from app.cli import main

main()
