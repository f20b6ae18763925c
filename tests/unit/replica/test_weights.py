"""Verified loading, the atomic swap and the local verified cache of a replica."""

from __future__ import annotations

import threading

import pytest
import torch

from app.replica.weights import Serving, VerificationError, WeightCache, WeightStore, load_verified
from kernels.delta.hashing import checkpoint_sha256, hash_state_dict


def test_load_verified_serves_exactly_the_published_weights(tiny):
    cfg, state = tiny(0)
    lv = load_verified("1", state, cfg, checkpoint_sha256(state))
    got = lv.policy.serving_state_dict()
    assert all(torch.equal(got[k].view(torch.int16), state[k].view(torch.int16)) for k in state)


def test_load_verified_refuses_one_flipped_bit(tiny):
    cfg, state = tiny(0)
    sha = checkpoint_sha256(state)
    bad = dict(state)
    name = next(iter(bad))
    t = bad[name].clone()
    t.view(torch.int16).view(-1)[0] ^= 1
    bad[name] = t
    with pytest.raises(VerificationError, match="hash"):
        load_verified("1", bad, cfg, sha)


def test_load_verified_with_the_codecs_digests_serves_exactly_those_weights(tiny):
    cfg, state = tiny(0)
    digests, sha = hash_state_dict(state)
    lv = load_verified("1", state, cfg, sha, digests=digests)
    got = lv.policy.serving_state_dict()
    assert lv.sha256 == sha and all(
        torch.equal(got[k].view(torch.int16), state[k].view(torch.int16)) for k in state
    )


def test_load_verified_refuses_digests_that_do_not_give_the_published_hash(tiny):
    cfg, state = tiny(0)
    _, other = tiny(1)
    digests, _ = hash_state_dict(state)
    with pytest.raises(VerificationError, match="digests"):
        load_verified("1", state, cfg, checkpoint_sha256(other), digests=digests)
    partial = dict(digests)
    partial.pop(next(iter(partial)))
    with pytest.raises(VerificationError, match="digests"):
        load_verified("1", state, cfg, checkpoint_sha256(state), digests=partial)


def test_a_version_built_from_a_held_one_serves_its_own_weights_and_leaves_the_held_one_intact(
    tiny,
):
    """The shadow policy copies the held version's structure without its weights (Policy.shadow):
    it must serve exactly the new weights, share no storage with the held policy, keep the
    non-persistent buffers, and leave the held version untouched (it may be serving requests)."""
    cfg, state0 = tiny(0)
    _, state1 = tiny(1)
    held = load_verified("1", state0, cfg, checkpoint_sha256(state0))
    before = {k: v.clone() for k, v in held.policy.state_dict().items()}
    new = load_verified("2", state1, cfg, checkpoint_sha256(state1), template=held)
    got = new.policy.serving_state_dict()
    assert all(torch.equal(got[k].view(torch.int16), state1[k].view(torch.int16)) for k in state1)
    assert all(torch.equal(v, before[k]) for k, v in held.policy.state_dict().items())
    old_ptrs = {t.data_ptr() for t in held.policy.state_dict().values()}
    assert not old_ptrs & {t.data_ptr() for t in new.policy.state_dict().values()}
    old_buffers = dict(held.policy.named_buffers())
    for name, b in new.policy.named_buffers():
        assert torch.equal(b, old_buffers[name]), name
    prompt, completion = [[1, 2, 3, 4]], [[5, 6, 7]]
    with torch.no_grad():  # the two policies compute with their own weights
        assert not torch.equal(
            new.policy.logprobs(prompt, completion), held.policy.logprobs(prompt, completion)
        )
        fresh = load_verified(
            "2", state1, cfg, checkpoint_sha256(state1)
        )  # built from scratch, no template
        assert torch.equal(
            new.policy.logprobs(prompt, completion), fresh.policy.logprobs(prompt, completion)
        )


def test_load_verified_refuses_loaded_weights_that_differ_from_the_verified_tensors(tiny):
    # a float16 tensor hashes fine as float16, but the policy serves it as bfloat16: the bitwise
    # comparison of what the policy serves against the verified tensors must catch it
    cfg, state = tiny(0)
    name = next(iter(state))
    odd = {**state, name: state[name].to(torch.float16)}
    digests, sha = hash_state_dict(odd)
    with pytest.raises(VerificationError, match="differ"):
        load_verified("1", odd, cfg, sha, digests=digests)


def test_swap_replaces_the_whole_snapshot_and_old_snapshots_stay_intact(tiny):
    cfg, s1 = tiny(1)
    _, s2 = tiny(2)
    v1 = load_verified("1", s1, cfg, checkpoint_sha256(s1))
    v2 = load_verified("2", s2, cfg, checkpoint_sha256(s2))
    store = WeightStore(Serving(champion=v1))
    before = store.snapshot()
    store.swap(candidate=v2, traffic_pct=25.0)
    assert before.candidate is None and before.traffic_pct == 0.0, (
        "a held snapshot must never change"
    )
    assert store.snapshot().versions() == {"champion": "1", "candidate": "2"}
    store.swap(candidate=None, traffic_pct=50.0)
    assert store.snapshot().traffic_pct == 0.0, "no candidate means no candidate traffic"


def test_concurrent_readers_only_ever_see_complete_snapshots(tiny):
    cfg, s1 = tiny(1)
    _, s2 = tiny(2)
    v1 = load_verified("1", s1, cfg, checkpoint_sha256(s1))
    v2 = load_verified("2", s2, cfg, checkpoint_sha256(s2))
    store = WeightStore(Serving(champion=v1, candidate=v2, traffic_pct=10.0))
    bad, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            s = store.snapshot()
            pair = (s.champion.version, s.candidate.version, s.traffic_pct)
            if pair not in {("1", "2", 10.0), ("2", "1", 90.0)}:
                bad.append(pair)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for r in readers:
        r.start()
    for i in range(2000):
        store.swap(
            **(
                {"champion": v2, "candidate": v1, "traffic_pct": 90.0}
                if i % 2 == 0
                else {"champion": v1, "candidate": v2, "traffic_pct": 10.0}
            )
        )
    stop.set()
    for r in readers:
        r.join()
    assert not bad, f"torn snapshots seen: {bad[:5]}"


def test_cache_restores_the_serving_versions_verified(tmp_path, tiny):
    cfg, s1 = tiny(1)
    _, s2 = tiny(2)
    v1 = load_verified("1", s1, cfg, checkpoint_sha256(s1))
    v2 = load_verified("2", s2, cfg, checkpoint_sha256(s2))
    cache = WeightCache(tmp_path)
    cache.put(v1)
    cache.put(v2)
    cache.set_serving(Serving(champion=v1, candidate=v2, traffic_pct=5.0))
    restored = WeightCache(tmp_path).restore()
    assert (
        restored.versions() == {"champion": "1", "candidate": "2"} and restored.traffic_pct == 5.0
    )
    assert restored.champion.sha256 == v1.sha256


def test_corrupt_cached_weights_are_dropped_and_the_previous_verified_version_serves(
    tmp_path, tiny
):
    cfg, s1 = tiny(1)
    _, s2 = tiny(2)
    cache = WeightCache(tmp_path)
    v1 = load_verified("1", s1, cfg, checkpoint_sha256(s1))
    v2 = load_verified("2", s2, cfg, checkpoint_sha256(s2))
    cache.put(v1)
    cache.put(v2)
    cache.set_serving(Serving(champion=v2))
    path = tmp_path / "v2.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # a bit flip inside the last tensor's bytes
    path.write_bytes(bytes(raw))
    restored = WeightCache(tmp_path).restore()
    assert restored.versions() == {"champion": "1", "candidate": None}
    assert "2" not in WeightCache(tmp_path).versions(), "the corrupt version must be removed"


def test_an_interrupted_write_leaves_no_servable_version(tmp_path, tiny):
    cfg, s1 = tiny(1)
    cache = WeightCache(tmp_path)
    (tmp_path / "v3.safetensors.tmp").write_bytes(b"half a file")
    (tmp_path / "v3.safetensors").write_bytes(b"no marker yet")
    cache = WeightCache(tmp_path)
    assert not (tmp_path / "v3.safetensors.tmp").exists()
    assert cache.versions() == [] and cache.restore().champion is None


def test_prune_keeps_the_newest_and_the_serving_versions(tmp_path, tiny):
    cache = WeightCache(tmp_path)
    cfg, _ = tiny(0)
    for v in range(1, 6):
        _, s = tiny(v)
        cache.put(load_verified(str(v), s, cfg, checkpoint_sha256(s)))
    cache.prune(keep=2, protect={"1"})
    assert cache.versions() == ["1", "4", "5"]


# --- a request's lease and the generation thread that outlives its handler ----------------------
def test_a_lease_held_by_a_running_generation_outlives_its_handlers_release():
    import threading

    from app.replica.weights import Leases

    leases = Leases()
    lease = leases.acquire()
    started, finish = threading.Event(), threading.Event()

    def generate() -> str:
        started.set()
        finish.wait(5)
        return "tokens"

    result: list[str] = []
    worker = threading.Thread(target=lambda: result.append(lease.run(generate)()))
    worker.start()
    assert started.wait(5)
    lease.release()  # the handler is cancelled while its generation runs
    assert leases.count == 1 and not leases.wait_idle(0.05), "released under a running generation"
    finish.set()
    worker.join(5)
    assert result == ["tokens"] and leases.count == 0 and leases.wait_idle(0)
    lease.release()  # idempotent
    assert leases.count == 0


def test_a_generation_that_starts_after_its_request_released_the_lease_does_not_run():
    from app.replica.weights import LeaseReleased, Leases

    leases = Leases()
    lease = leases.acquire()
    ran = []
    wrapped = lease.run(lambda: ran.append(1))
    lease.release()
    with pytest.raises(LeaseReleased):
        wrapped()
    assert ran == [] and leases.count == 0


def test_a_finished_generation_leaves_the_lease_to_its_holder():
    from app.replica.weights import Leases

    leases = Leases()
    lease = leases.acquire()
    assert lease.run(lambda x: x + 1)(1) == 2
    assert leases.count == 1  # the request still holds it (events not yet written)
    lease.release()
    assert leases.count == 0
