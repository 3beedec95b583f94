"""What the trainer's store keeps: the versions live workers, a restart and an export can still
ask for; everything else is pruned after each publish (trainer/retention.py)."""

from support.tensors import layer, mutate, random_tensor, same, versions

from sparrowrl.rollout.coordinator import Coordinator
from sparrowrl.store.store import Store
from sparrowrl.trainer import retention


def test_the_oldest_needed_is_what_the_laggard_holds_the_staleness_allows_or_the_previous_base():
    bases = [0, 5, 10]
    # everyone current: the version before the newest base, so the previous base (5) stays
    assert retention.oldest_needed(12, bases, [12, 11], staleness=1) == 9
    # a live worker three versions behind the newest base holds its chain
    assert retention.oldest_needed(12, bases, [7, 12], staleness=1) == 7
    # a larger staleness bound keeps the versions results may still be generated with
    assert retention.oldest_needed(12, bases, [12], staleness=4) == 8
    # an export of v3 in flight (held like a worker's version)
    assert retention.oldest_needed(12, bases, [12, 3], staleness=0) == 3
    # nobody live: still the version before the newest base; never below v0
    assert retention.oldest_needed(12, bases, [], staleness=0) == 9
    assert retention.oldest_needed(3, [0], [], staleness=8) == 0
    # full sync (a base every version): the newest two stay
    assert retention.oldest_needed(7, range(8), [7], staleness=0) == 6


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_store_pruned_for_its_live_workers_still_serves_them_and_a_restart(rng, tmp_path):
    """A real store, a real coordinator on a clock: a live worker at v6 keeps v6's chain, a lost
    one at v1 keeps nothing; what is left is exactly what the index names, and `Held` says so."""
    states = versions(rng, layer(rng, 128, 64), 12, 0.01)
    store = Store.init(tmp_path / "s", states[0], base_every=4)
    clock = Clock()
    coord = Coordinator(2, 1, lease_seconds=10, staleness=1, steps=20, split="pull", clock=clock)
    coord.publish(0, store.versions[0].state_hash)
    coord.commit("lost", 0, store.versions[0].state_hash)
    for v in range(1, 13):
        store.add(states[v])
        coord.publish(v, store.versions[v].state_hash)
        if v == 1:
            coord.commit("lost", 1, store.versions[1].state_hash)
        if v == 6:
            clock.t = 11.0  # "lost" was last heard at t=0: no longer live
            coord.commit("slow", 6, store.versions[6].state_hash)
        held = retention.prune(store, retention.needed(store, coord, exporting=None))
    assert coord.fleet.live() == ["slow"]
    assert sorted(store.versions) == list(range(4, 13))  # base v4 serves v6; v0..v3 are gone
    assert held == retention.Held(pruned=4, versions=9, bytes=held.bytes)
    on_disk = [*(store.path / "deltas").iterdir(), *(store.path / "bases").iterdir()]
    assert held.bytes == sum(f.stat().st_size for f in on_disk)
    assert sorted(f.name for f in on_disk if f.suffix == ".spd") == sorted(
        store.versions[v].delta for v in range(5, 13)
    )
    p = store.plan(6, 12)  # the slow worker catches up by its chain
    assert p.route == "chain" and p.deltas == list(range(7, 13))
    have = {k: x.clone() for k, x in states[6].items()}
    assert same(store.materialize(12, have=(6, have, store.versions[6].state_hash)), states[12])
    assert same(Store(store.path).materialize(12), states[12])  # a restarted trainer's newest

    coord.commit("slow", 12, store.versions[12].state_hash)  # caught up: only the previous base is kept
    orphan = store.path / "deltas" / "v00000002-0123456789abcdef.spd"  # unlisted by a prune killed before its unlinks
    orphan.write_bytes(b"x")
    index = (store.path / "store.json").stat().st_ino
    held = retention.prune(store, retention.needed(store, coord, exporting=None))
    assert sorted(store.versions) == list(range(8, 13)) and held.pruned == 8 and not orphan.exists()
    assert retention.prune(store, retention.needed(store, coord, exporting=None)) == held
    assert (store.path / "store.json").stat().st_ino != index  # rewritten once, by the prune that dropped files
    index = (store.path / "store.json").stat().st_ino
    retention.prune(store, retention.needed(store, coord, exporting=None))
    assert (store.path / "store.json").stat().st_ino == index  # nothing to drop: readers are not woken
    # an export of v9 in flight holds v9 back even once the workers are past the next base
    held = retention.prune(store, retention.needed(store, coord, exporting=9))
    assert min(store.versions) == 8


def test_a_prune_that_drops_only_an_index_entry_still_writes_the_index(tmp_path, rng):
    """A relay's mirror starts at a version whose files it never fetched: pruning it removes no
    file but must still drop its entry."""
    s0 = {"w": random_tensor(rng, "BF16", (64, 64))}
    src = Store.init(tmp_path / "src", s0, base_every=2)
    for _ in range(4):
        src.add({"w": mutate(rng, src.materialize(src.newest)["w"], 0.01)})
    mirror = Store.mirror(tmp_path / "m", 2, 1, src.versions[1].state_hash)
    for v in range(2, 5):
        (mirror.path / "deltas" / src.versions[v].delta).write_bytes(
            (src.path / "deltas" / src.versions[v].delta).read_bytes()
        )
        entry = src.versions[v]
        if v != 2:
            entry = type(entry)(**{**vars(entry), "base": None, "base_bytes": 0, "base_parts": []})
        mirror.record(entry)
    (mirror.path / "bases" / src.versions[2].base).write_bytes((src.path / "bases" / src.versions[2].base).read_bytes())
    assert mirror.prune(keep=2) == [1]
    assert sorted(Store(mirror.path).versions) == [2, 3, 4]


def test_a_restarted_trainer_does_not_call_a_commit_of_a_pruned_version_a_mismatch():
    """Its coordinator knows the hashes its store lists: a worker's last commit of a version
    pruned since is shown as not known, not as a mismatch."""
    before = Coordinator(2, 1, lease_seconds=10, staleness=1, steps=20, split="pull")
    before.publish(1, "a" * 16)
    assert before.commit("gone", 1, "a" * 16)
    after = Coordinator(2, 1, lease_seconds=10, staleness=1, steps=20, split="pull")
    after.publish(8, "b" * 16)  # the store kept v8 on
    after.restore(before.state(), taken=8, results={})
    (w,) = after.view().workers
    assert w.committed == (1, "a" * 16) and w.verified is None and after.view().counts.mismatched == 0
