"""The checkpoint store: bases every K versions, content-hashed deltas, cheapest plans, pruning."""

import asyncio
import hashlib
import json
import threading

import numpy as np
import pytest
from support.tensors import layer, mutate, mutated, random_tensor, same, stored, versions

from sparrowrl.delta import state_hash
from sparrowrl.store.changes import listen
from sparrowrl.store.store import Store, StoreError
from sparrowrl.transport.watch import Watch


@pytest.fixture
def chain(rng, tmp_path):
    states = versions(rng, layer(rng, 256, 64), 12, 0.01)
    return stored(tmp_path / "s", states, base_every=5), states


def test_every_version_materializes_exactly(chain):
    store, states = chain
    assert sorted(store.versions) == list(range(13))
    assert [v for v, x in store.versions.items() if x.base] == [0, 5, 10]
    for v, s in enumerate(states):
        assert store.versions[v].state_hash == state_hash(s)
        assert same(store.materialize(v), s)


def test_deltas_are_content_hashed_and_immutable(chain):
    store, _ = chain
    for v in range(1, 13):
        x = store.versions[v]
        assert x.delta.startswith(f"v{v:08d}-{x.delta_sha256[:16]}")
    victim = store.path / "deltas" / store.versions[7].delta
    data = bytearray(victim.read_bytes())
    data[100] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="delta v7 .* does not match its content hash"):
        store.materialize(8)


def test_plan_picks_fewest_bytes(chain):
    store, _ = chain
    p = store.plan(6, 8)
    assert (p.route, p.deltas) == ("chain", [7, 8])
    far = store.plan(1, 12)  # 11 deltas vs base 10 + 2 deltas: depends on sizes; must be the cheaper one
    chain_bytes = sum(store.versions[d].delta_bytes for d in range(2, 13))
    base_bytes = store.versions[10].base_bytes + sum(store.versions[d].delta_bytes for d in (11, 12))
    assert far.bytes == min(chain_bytes, base_bytes)
    assert store.plan(None, 7).route == "base" and store.plan(None, 7).base == 5
    assert store.plan(12, 12).route == "none"
    with pytest.raises(StoreError, match="version 40 is not in the store"):
        store.plan(None, 40)


def test_catch_up_from_a_held_version(chain):
    store, states = chain
    held = {k: v.clone() for k, v in states[3].items()}
    out = store.materialize(9, have=(3, held, state_hash(held)))
    assert same(out, states[9])


def test_prune_keeps_newest_reachable(chain):
    store, states = chain
    removed = store.prune(keep=4)  # keep 9..12: base 5 serves v9
    assert removed == [0, 1, 2, 3, 4]
    store = Store(store.path)
    assert min(store.versions) == 5 and store.versions[5].delta is None
    for v in range(9, 13):
        assert same(store.materialize(v), states[v])
    on_disk = {p.name for p in (store.path / "deltas").iterdir()}
    assert on_disk == {store.versions[v].delta for v in range(6, 13)}


def test_index_survives_reopen(chain, tmp_path):
    store, _ = chain
    data = json.loads((store.path / "store.json").read_text())
    assert data["base_every"] == 5 and len(data["versions"]) == 13
    with pytest.raises(StoreError, match="not a sparrowrl store"):
        Store(tmp_path / "nowhere")


def test_a_small_base_is_cut_into_parts_for_every_stream_and_an_older_index_still_opens(rng, tmp_path):
    from sparrowrl.store.index import BASE_PART, BASE_PARTS, MIN_BASE_PART, part_bytes

    state = {"w": random_tensor(rng, "BF16", (3000, 1000))}  # 6 MB: one part of BASE_PART would feed one stream
    store = Store.init(tmp_path / "s", state)
    v = store.versions[0]
    assert v.base_part_bytes == 128 << 10 and BASE_PARTS // 2 < len(v.base_parts) <= BASE_PARTS
    assert part_bytes(1) == MIN_BASE_PART and part_bytes(100 * BASE_PART) == BASE_PART
    # an index written before parts were sized by the base: its one part of BASE_PART
    index = json.loads((store.path / "store.json").read_text())
    entry = index["versions"][0]
    del entry["base_part_bytes"]
    with open(store.path / "bases" / entry["base"], "rb") as f:
        entry["base_parts"] = [hashlib.sha256(f.read()).hexdigest()]
    assert entry["base_bytes"] < BASE_PART
    (store.path / "store.json").write_text(json.dumps(index))
    again = Store(store.path)
    assert again.versions[0].base_part_bytes == BASE_PART and same(again.materialize(0), state)


def test_store_and_forward_publishes_a_delta_no_reader_sees_until_sealed(chain):
    """`cut_through=False` (what the benchmarks compare against): nothing is listed as being
    written, and a writer's leftover is removed like a partial delta."""
    from sparrowrl.delta.tensors import TensorSpec

    store, states = chain
    new = mutated(np.random.default_rng(1), states[-1], 0.01)
    old = store.materialize(store.newest)
    with store.publish([TensorSpec.of(n, t) for n, t in new.items()], cut_through=False) as w:
        w.add((n, old[n], new[n]) for n in new)
        assert store.producing() == [] and list((store.path / "deltas").glob(".v*.sealing"))
    assert same(store.materialize(store.newest), new) and not list((store.path / "deltas").glob(".v*"))
    (store.path / "deltas" / f".v{store.newest + 1:08d}.sealing").write_bytes(b"half")
    store.drop_partial()
    assert not list((store.path / "deltas").glob(".v*"))


def test_a_store_written_in_this_process_tells_its_server(tmp_path):
    """The trainer's server does not poll its store: the store it writes tells it of a new
    version (here from a worker thread, as the learner publishes). Were the tell lost, the wait
    would run its full 30 s and the test's deadline would fail it."""
    rng = np.random.default_rng(5)
    state = {"w": random_tensor(rng, "BF16", (64, 32))}
    store = Store.init(tmp_path / "s", state, base_every=4)

    async def wait_for_the_tell() -> None:
        watch = Watch(store.path, polled=False)
        undo = listen(store.path, watch.poke)
        watch.start(asyncio.get_running_loop())
        waiting = asyncio.create_task(watch.changed(30))
        await asyncio.sleep(0)
        adding = threading.Thread(target=store.add, args=({"w": mutate(rng, state["w"], 0.1)},))
        adding.start()
        async with asyncio.timeout(20):  # the delta's first chunk, or the index: either tells
            await waiting
        undo()
        adding.join()

    asyncio.run(wait_for_the_tell())
    assert Store(store.path).newest == 1
