"""The dashboard of a live arbiter (``serve --http``) in a real browser: a real ``ArbiterServer``
with its gRPC side, journal and a real MQTT broker (Mosquitto on 127.0.0.1:1883), real agents
(``AgentClient`` with the real bidding code), and Playwright driving Debian's Chromium. The page
learns of grants over its live stream; a round's page lists the bidders and draws the service's own
event log recorded; a revoked viewer token is refused at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request

from arbiter.publisher import RoundClosed
from protos.rpc import viewer_token
from tests.service_kit import ADMIN, arbiter, start_agent, target, wait_for
from tests.test_dashboard import CELLS, HELD_BY, browser_page, run

BROKER = "mqtt://127.0.0.1:1883"


def _held(server, app: str) -> list[str]:
    return sorted(lease.gpu for lease in server.service.engine.leases if lease.app == app)


def _rounds_with_a_lottery(server) -> list[RoundClosed]:
    return [e for e in server.service.events.recent
            if isinstance(e, RoundClosed) and any(c.won is not None for c in e.contenders())]


async def _stop(*tasks: asyncio.Task) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(BaseException):
            await task


def test_the_live_map_shows_a_grant_and_a_rounds_page_lists_its_bidders_and_draws(tmp_path):
    async def main():
        async with arbiter(tmp_path, http="127.0.0.1:0", mqtt=BROKER, lease_s=3.0, coalesce_s=0.05) as server:
            url = server.dashboard.url
            async with browser_page() as page:
                await page.goto(url + "#/cluster")
                await page.wait_for_selector("html[data-painted]", state="attached")
                await page.wait_for_function("document.getElementById('status').textContent === 'live'")
                _, first = await start_agent(server, "search-a")
                await wait_for(lambda: _held(server, "search-a"), 20)
                await page.wait_for_function(HELD_BY, arg=[_held(server, "search-a"), "search-a"], timeout=20_000)
                _, second = await start_agent(server, "search-b")
                try:
                    await wait_for(lambda: _rounds_with_a_lottery(server), 60)
                    closed = _rounds_with_a_lottery(server)[-1]
                    await page.goto(url + f"#/rounds/{closed.round_id}")
                    await page.wait_for_selector(f"html[data-round='{closed.round_id}']", state="attached")
                    ranked = await page.eval_on_selector_all("#round-ranked tbody tr", f"rows => rows.map({CELLS})")
                    contenders = await page.eval_on_selector_all("#round-contenders tbody tr",
                                                                 f"rows => rows.map({CELLS})")
                finally:
                    await _stop(first, second)
            return closed, ranked, contenders

    closed, ranked, contenders = run(main())
    offered = [row[1].strip() for row in ranked if row[5].strip() == "yes"]
    assert offered == [b.app for b in closed.bidders()], "the page's bidders, in rank order, are the round's"
    by_app = {row[0].strip(): row for row in contenders}
    drawn = [c for c in closed.contenders() if c.won is not None]
    assert drawn
    for c in drawn:
        row = by_app[c.app]
        shown = f"{c.c:.3f}" if c.c is not None else f"{c.c_bounds[0]:.3f}\u2013{c.c_bounds[1]:.3f}"  # D39
        assert row[4].strip() == shown, (row, c)
        assert row[6].strip() == ("won" if c.won else "lost"), (row, c)


def test_off_loopback_the_dashboard_takes_a_viewer_token_until_it_is_revoked(tmp_path):
    async def main():
        async with arbiter(tmp_path, http="0.0.0.0:0") as server:
            api = f"http://127.0.0.1:{server.dashboard.port}/api/v1/apps"

            def status(token: str | None) -> int:
                request = urllib.request.Request(api, headers={"Authorization": f"Bearer {token}"} if token else {})
                try:
                    with urllib.request.urlopen(request, timeout=10) as reply:
                        json.load(reply)
                        return reply.status
                except urllib.error.HTTPError as exc:
                    return exc.code

            before = await asyncio.to_thread(status, None)
            token = (await viewer_token(target(server), "ops-screen", ADMIN)).token
            with_token = await asyncio.to_thread(status, token)
            revoked = (await viewer_token(target(server), "ops-screen", ADMIN, revoke=True)).revoked
            after = await asyncio.to_thread(status, token)
            return before, token, with_token, revoked, after

    before, token, with_token, revoked, after = run(main())
    assert before == 401 and with_token == 200 and revoked == 1 and after == 401
    assert token.startswith("view_")
