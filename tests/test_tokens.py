"""Credentials that expire and are revoked: a role token past its expiry (and the clock-skew
bound) is refused, and the refreshed token its file is given serves the next request of the same
process, with no restart; a name's token of an older generation is refused once a newer one has
been seen (a replaced pod's). Tokens without either last as long as the job's key."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import pytest
from support.servers import EXE, TOKEN, free_port, get, start_server
from support.wait import until

from sparrowrl.auth.credential import Credential
from sparrowrl.auth.signing import Signer, public_text
from sparrowrl.auth.tokens import SKEW, Claims, Gate, Principal, claims, mint

SIGNER = Signer(TOKEN)
NOW = 1_800_000_000


def bearer(token: str) -> str:
    return f"Bearer {token}"


def test_a_token_is_taken_until_its_expiry_and_the_skew_bound_then_refused():
    gate = Gate(None, SIGNER.verifier)
    token = mint(SIGNER, "worker", "w-*", expires=NOW)
    assert gate.check(bearer(token), now=NOW - 1) == Principal("worker", "w-*")
    assert gate.check(bearer(token), now=NOW + SKEW) == Principal("worker", "w-*")  # a clock behind by SKEW
    why = gate.check(bearer(token), now=NOW + SKEW + 1)
    assert why == "the token expired at 2027-01-15T08:00:00Z"
    assert gate.check(bearer(mint(SIGNER, "worker", "w-*")), now=NOW * 2) == Principal("worker", "w-*")  # none


def test_a_newer_generation_of_a_name_revokes_the_older_one_from_then_on():
    gate = Gate(None, SIGNER.verifier)
    old, new = (mint(SIGNER, "worker", "job-worker-eu-0-*", generation=g) for g in (1, 2))
    other = mint(SIGNER, "worker", "job-worker-eu-1-*", generation=1)
    assert gate.check(bearer(old)) == Principal("worker", "job-worker-eu-0-*")
    assert gate.check(bearer(new)) == Principal("worker", "job-worker-eu-0-*")  # the replacement calls in
    assert gate.check(bearer(old)) == "the token of generation 1 was replaced by generation 2"
    assert gate.check(bearer(new)) == Principal("worker", "job-worker-eu-0-*")
    assert isinstance(gate.check(bearer(other)), Principal)  # another slot's own generations
    plain = mint(SIGNER, "worker", "job-worker-eu-0-*")  # a pod's from before generations
    assert gate.check(bearer(plain)) == "the token has no generation, and its name's is 2"
    forged = mint(Signer("another job"), "worker", "job-worker-eu-0-*", generation=99)
    assert isinstance(gate.check(bearer(forged)), str) and gate.check(bearer(new)) == Principal(
        "worker", "job-worker-eu-0-*"
    )  # an unsigned generation moves nothing


def test_claims_read_back_what_was_minted_and_refuse_what_no_one_mints():
    token = mint(SIGNER, "relay", "eu", expires=NOW, generation=7)
    assert claims(token) == Claims(Principal("relay", "eu"), NOW, 7)
    assert claims(mint(SIGNER, "relay", "eu")) == Claims(Principal("relay", "eu"))
    assert claims(TOKEN) is None and claims("sprl1.!!.x") is None
    for bad in (-1, 2**53):
        with pytest.raises(ValueError, match="out of range"):
            mint(SIGNER, "relay", "eu", expires=bad)


def write(path: Path, text: str) -> None:
    """As a kubelet updates a Secret's volume: the new file in place by one rename."""
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_a_token_file_is_read_again_when_it_changes_and_a_bad_one_keeps_the_last(tmp_path, caplog):
    f = tmp_path / "token"
    write(f, "first\n")
    c = Credential(path=f)
    assert c.get() == "first"
    write(f, "second")
    assert c.get() == "second"
    with caplog.at_level(logging.ERROR):
        write(f, "")  # half written
        assert c.get() == "second" and "not a token" in caplog.text
    f.unlink()
    assert c.get() == "second"
    write(f, "third")
    assert c.get() == "third"
    with pytest.raises(ValueError, match="SPARROWRL_TOKEN_FILE .*missing"):
        Credential(path=tmp_path / "missing")


def test_a_token_and_a_token_file_both_set_are_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARROWRL_TOKEN", "x")
    monkeypatch.setenv("SPARROWRL_TOKEN_FILE", str(tmp_path / "t"))
    with pytest.raises(ValueError, match="not both"):
        Credential.from_env()


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_an_expired_token_is_refused_and_its_refreshed_successor_works_in_the_same_process(history, tmp_path):
    """A relay whose token file holds an expired token is refused by its upstream and says why;
    the operator's refresh (a new token in the file) is read by the same process, which syncs. A
    token of the relay's name from an older generation is refused from then on."""
    path, _ = history
    origin_port, relay_port = free_port(), free_port()
    origin = start_server(path, origin_port)
    file = tmp_path / "token"
    expired = int(time.time()) - SKEW - 60
    write(file, mint(SIGNER, "relay", "eu", expires=expired, generation=1))
    env = {k: v for k, v in os.environ.items() if k != "SPARROWRL_TOKEN"}
    env |= {"SPARROWRL_TOKEN_FILE": str(file), "SPARROWRL_TRAINER_KEY": public_text(SIGNER.key)}
    log = tmp_path / "relay.log"
    with log.open("w") as out:
        relay = subprocess.Popen(
            [str(EXE), "relay", "--upstream", f"http://127.0.0.1:{origin_port}", "--port", str(relay_port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        until(lambda: "the token expired at" in log.read_text(), 60, "the upstream refusing the expired token")
        assert get(f"http://127.0.0.1:{relay_port}/readyz") == 503  # not synced
        write(file, mint(SIGNER, "relay", "eu", expires=int(time.time()) + 3600, generation=2))
        until(lambda: get(f"http://127.0.0.1:{relay_port}/readyz") == 200, 60, "the relay synced, same process")
        assert relay.poll() is None and f"token: read {file} again" in log.read_text()
        old = mint(SIGNER, "relay", "eu", expires=int(time.time()) + 3600, generation=1)  # a copy from before
        status = _get_with(f"http://127.0.0.1:{origin_port}/v1/versions", old)
        assert status == (401, "the token of generation 1 was replaced by generation 2")
    finally:
        relay.kill()
        origin.kill()


def _get_with(url: str, token: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": bearer(token)})) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_token_goes_to_the_servers_alone_not_where_a_redirect_points():
    """A server (or a proxy before it) that redirects elsewhere does not get the token sent there:
    each request carries it only to the origins the client was given."""
    import asyncio

    from aiohttp import web
    from support.servers import serving

    from sparrowrl.transport.client import Client

    seen: dict[str, str] = {}

    async def main():
        async def elsewhere(request: web.Request) -> web.Response:
            seen["elsewhere"] = request.headers.get("Authorization", "")
            return web.json_response({"ok": True})

        other = web.Application()
        other.add_routes([web.get("/x", elsewhere)])
        async with serving(other) as far:

            async def ours(request: web.Request) -> web.Response:
                seen["ours"] = request.headers.get("Authorization", "")
                raise web.HTTPTemporaryRedirect(f"{far}/x")

            app = web.Application()
            app.add_routes([web.get("/x", ours)])
            async with serving(app) as url, Client(url, token="the-token", trust=None, attempts=1) as c:
                assert await c.json("/x") == {"ok": True}

    asyncio.run(main())
    assert seen == {"ours": "Bearer the-token", "elsewhere": ""}
