"""`--dist loadgroup` that works under pytest 9.2: pytest-xdist 3.8 puts a test's xdist_group in its
id by setting `item._nodeid`, which pytest 9.2 no longer reads (the id is `item._id`). Every group
was ignored, so a group's tests ran on both processes and built their session fixtures twice, and
the operator's end-to-end tests, meant to run one after the other, ran together."""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)  # after xdist's own hook, which sets the suffixed id
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        suffixed = item.__dict__.get("_nodeid")
        if isinstance(suffixed, str) and suffixed != item.nodeid and hasattr(item, "_id"):
            from _pytest.nodeid import coerce_node_id  # pytest >= 9.2, where the id is structured

            item._id = coerce_node_id(suffixed)
