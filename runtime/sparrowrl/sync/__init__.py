"""Weight sync for any trainer and any rollout engine, as a library: the public API (version 1).

    trainer                                     each rollout server
    Publisher(model, "store").publish()  ──▶  Origin ──▶ relays ──▶  Subscriber(urls, tensors).pull()

A `Publisher` turns each optimizer step into a lossless sparse delta of the bf16 policy, written
into a store; an `Origin` (or `sparrowrl serve STORE`) serves it, signed; a `Subscriber` pulls it
through relays, verifies it, and applies it in place, bit-exact to the trainer's bf16 cast, checked
by state hash. SparrowRL's own trainer and workers are built on these three. docs/api.md shows
them in a plain PyTorch loop.
"""

from sparrowrl.delta.errors import DeltaError, MismatchError
from sparrowrl.sync.origin import Origin
from sparrowrl.sync.publisher import Publisher
from sparrowrl.sync.subscriber import Staged, Subscriber
from sparrowrl.transport.failover import FetchError

API_VERSION = 1  # bumped when a name here changes what it takes or gives

__all__ = ["API_VERSION", "DeltaError", "FetchError", "MismatchError", "Origin", "Publisher", "Staged", "Subscriber"]
