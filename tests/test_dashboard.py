"""The web dashboard in a real browser: Playwright drives Debian's Chromium (``/usr/bin/chromium``,
scripts/install_browser.sh) headless against the real server (``arbiter.dashboard``).

* a real simulated run, recorded (``themis-sim run --record-rounds``) and served by ``themis-sim view``
  in its own process: a round's page lists its bidders in rank order and each lottery draw, won or
  lost as the draw and c_i say; the time slider moves the map to the leases of that round; the
  recorded run's summary is the unrecorded one's;
* the API's JSON, and the round views read back from it;
* viewer tokens: refused when unknown or revoked, accepted as a bearer or once in the address (then
  as an HttpOnly cookie), never shown; TLS;
* a live page fed through a ``MemorySource`` by a real round engine with real agents: a grant shows
  on the map.

Each page is also saved as a screenshot into docs/images/. Nothing waits on a clock: every wait is on
the page's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from playwright.async_api import async_playwright

from agent.agent import Agent
from agent.appsched import SuccessiveHalvingApp
from arbiter.cluster import cluster_from_mapping
from arbiter.dashboard import EngineFeed, MemorySource, start
from arbiter.dashboard.access import fixed_verifier, is_loopback, issue_viewer_token, store_verifier, tls_context
from arbiter.dashboard.memory import shown_settings
from arbiter.dashboard.model import (
    AppView,
    ClusterLayout,
    GpuPlace,
    LeaseView,
    RoundView,
    from_json,
    to_json,
)
from arbiter.dashboard.recording import RECORDING, RecordingError, load_recording
from arbiter.policies import make_policy
from arbiter.rounds import RoundEngine
from arbiter.store import Store

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"
SIM = [sys.executable, "-m", "simulator"]


def run(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def browser_page(width: int = 1400, height: int = 1000):
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = await browser.new_page(viewport={"width": width, "height": height})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            yield page
            assert not errors, f"the page raised: {errors}"
        finally:
            await browser.close()


# -- a recorded simulated run, served by themis-sim view ------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """``themis-sim run --workload small`` twice: with --record-rounds (returned) and without."""
    base = tmp_path_factory.mktemp("sim")
    common = ["run", "--workload", "small", "--cluster", "sim-256", "--seed", "0"]
    for name, extra in (("recorded", ["--record-rounds"]), ("plain", [])):
        subprocess.run([*SIM, *common, *extra, "--out", str(base / name)], check=True, cwd=ROOT,
                       capture_output=True, timeout=600)
    return base


@pytest.fixture(scope="module")
def view(recorded):
    """``themis-sim view`` on the recorded run, in its own process; yields its address."""
    proc = subprocess.Popen([*SIM, "view", str(recorded / "recorded"), "--port", "0"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline()
        match = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
        assert match, f"themis-sim view said {line!r}, stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        yield match.group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_recorded_run_has_the_summary_of_an_unrecorded_one(recorded):
    with_rec = json.loads((recorded / "recorded" / "summary.json").read_text())
    without = json.loads((recorded / "plain" / "summary.json").read_text())
    assert (recorded / "recorded" / RECORDING).is_file() and not (recorded / "plain" / RECORDING).exists()
    for summary in (with_rec, without):
        summary.pop("wall_seconds")
    assert with_rec == without


def _a_telling_round(source: MemorySource) -> RoundView:
    """A round with several apps ranked and at least one PF winner that won its draw and one that lost."""
    for rid, _ in source.timeline().rounds:
        view = source.round(rid)
        rows = [c for c in view.contenders if c.pf_row]
        if len(view.ranked) >= 4 and any(c.won for c in rows) and any(not c.won for c in rows):
            return view
    raise AssertionError("the run has no round with a won and a lost lottery")


def test_a_rounds_page_lists_its_bidders_in_rank_order_and_every_lottery_draw(recorded, view):
    source = load_recording(recorded / "recorded" / RECORDING)
    chosen = _a_telling_round(source)

    async def main():
        async with browser_page() as page:
            await page.goto(f"{view}#/rounds/{chosen.round_id}")
            await page.wait_for_selector(f"html[data-round='{chosen.round_id}']", state="attached")
            ranked = await page.eval_on_selector_all("#round-ranked tbody tr", "rows => rows.map(r => "
                                                     "Array.from(r.cells).map(c => c.textContent.trim()))")
            contenders = await page.eval_on_selector_all("#round-contenders tbody tr", "rows => rows.map(r => "
                                                         "Array.from(r.cells).map(c => c.textContent.trim()))")
            await page.locator("body").screenshot(path=str(IMAGES / "dashboard-round.png"))
            return ranked, contenders

    ranked, contenders = run(main())
    assert [row[1] for row in ranked] == [r.app for r in chosen.ranked]
    assert [row[5] == "yes" for row in ranked] == [r.offered for r in chosen.ranked]
    bidders = [row[1] for row in ranked if row[5] == "yes"]
    assert bidders == list(chosen.bidders) and bidders
    assert [row[0] for row in contenders] == [c.app for c in chosen.contenders]
    for row, c in zip(contenders, chosen.contenders):
        if not c.pf_row:
            continue
        assert row[4] == f"{c.c:.3f}" and row[5] == f"{c.draw:.3f}"
        assert row[6] == ("won" if c.draw < c.c else "lost"), "D15: a PF winner keeps its row iff its draw < c_i"
        assert c.won == (c.draw < c.c)


def test_the_time_slider_moves_the_map_to_each_rounds_leases(recorded, view):
    source = load_recording(recorded / "recorded" / RECORDING)
    rounds = [rid for rid, _ in source.timeline().rounds]
    holders = {rid: {g.id: g.holder for g in source.cluster(rid).gpus} for rid in rounds}
    busy = [rid for rid in rounds if any(holders[rid].values())]
    first, second = next((a, b) for a in busy for b in reversed(busy) if a < b and holders[a] != holders[b])

    async def main():
        async with browser_page() as page:
            await page.goto(f"{view}#/cluster")
            await page.wait_for_selector("html[data-painted]", state="attached")
            seen = {}
            for rid in (first, second):
                await page.eval_on_selector("#slider", SLIDE, rounds.index(rid))
                await page.wait_for_selector(f"html[data-at='{rid}']", state="attached")
                seen[rid] = await page.eval_on_selector_all(
                    ".gpu", "cells => Object.fromEntries(cells.map(c => [c.dataset.g, c.dataset.app || null]))")
                assert await page.text_content("#slider-label") == f"round {rid} (t={_dur(source.round(rid).now)})"
            fairness = source.fairness(points=100_000)
            busiest = fairness.round_id[fairness.utilisation.index(max(fairness.utilisation))]
            await page.goto(f"{view}#/cluster?at={busiest}")
            await page.wait_for_selector(f"html[data-at='{busiest}']", state="attached")
            await page.locator("body").screenshot(path=str(IMAGES / "dashboard-cluster.png"))
            await page.goto(f"{view}#/fairness")
            await page.wait_for_selector("html[data-fairness]", state="attached")
            await page.wait_for_selector("#chart-gpus canvas", state="attached")
            await page.locator("body").screenshot(path=str(IMAGES / "dashboard-fairness.png"))
            return seen

    seen = run(main())
    assert seen[first] == holders[first] and seen[second] == holders[second]
    assert seen[first] != seen[second]


SLIDE = "(el, i) => { el.value = i; el.dispatchEvent(new Event('input')); }"


def _dur(s: float) -> str:
    """The page's way of writing a simulated time."""
    s = abs(s)
    h, m, sec = int(s // 3600), int((s % 3600) // 60), int(s % 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


# -- the API ---------------------------------------------------------------------------------------


def test_the_api_json_shapes_and_errors(recorded):
    source = load_recording(recorded / "recorded" / RECORDING)
    chosen = _a_telling_round(source)

    async def main():
        dashboard = await start("127.0.0.1", 0, source)
        out = {}
        try:
            async with aiohttp.ClientSession() as http:
                for name, path in (("index", "api/v1"), ("cluster", "api/v1/cluster"), ("apps", "api/v1/apps"),
                                   ("rounds", "api/v1/rounds?limit=5"), ("round", f"api/v1/rounds/{chosen.round_id}"),
                                   ("fairness", "api/v1/fairness?points=50"), ("events", "api/v1/events?limit=20"),
                                   ("grants", "api/v1/events?kind=grant&limit=5"), ("settings", "api/v1/settings"),
                                   ("timeline", "api/v1/timeline"), ("at", f"api/v1/cluster?at={chosen.round_id}"),
                                   ("app_rounds", f"api/v1/apps/{chosen.ranked[0].app}/rounds"),
                                   ("gone_app", f"api/v1/apps/{chosen.ranked[0].app}"),
                                   ("bad_limit", "api/v1/rounds?limit=x"), ("bad_at", "api/v1/cluster?at=-1"),
                                   ("bad_kind", "api/v1/events?kind=nonsense"), ("missing", "api/v1/rounds/999999"),
                                   ("no_app", "api/v1/apps/nobody")):
                    async with http.get(dashboard.url + path) as reply:
                        out[name] = (reply.status, reply.headers.get("Content-Type", ""), await reply.json())
        finally:
            await dashboard.stop()
        return out

    out = run(main())
    for name in ("index", "cluster", "apps", "rounds", "round", "fairness", "events", "settings", "timeline", "at",
                 "app_rounds", "gone_app"):
        assert out[name][0] == 200 and out[name][1].startswith("application/json"), name
    assert out["index"][2]["api"] == 1 and "/api/v1/rounds/{id}" in out["index"][2]["endpoints"].values()
    cluster = out["cluster"][2]
    assert len(cluster["gpus"]) == 256
    assert set(cluster["gpus"][0]) >= {"id", "rack", "machine", "holder", "lease_end"}
    at = out["at"][2]
    assert at["at"] == chosen.round_id and any(g["holder"] for g in at["gpus"])
    rounds = out["rounds"][2]["rounds"]
    assert len(rounds) == 5 and rounds[0]["round_id"] > rounds[-1]["round_id"]
    one = out["round"][2]
    assert from_json(RoundView, {k: v for k, v in one.items() if k != "bidders"}) == chosen
    assert one["bidders"] == list(chosen.bidders)
    for c in one["contenders"]:
        assert set(c) == {"app", "admitted", "shadow", "pf_row", "pf_rho", "c", "draw", "won", "c_bounds"}
        if c["pf_row"] and c["c"] is not None:
            assert c["won"] == (c["draw"] < c["c"])
        elif c["pf_row"]:  # D39: the bounds decided the lottery
            lo, hi = c["c_bounds"]
            assert c["won"] == (c["draw"] < lo) and (c["won"] or c["draw"] >= hi)
    ranks = [r["rho"] for r in one["ranked"] if not r["offered"]]
    assert [math.inf if r == "inf" else r for r in ranks] == sorted((math.inf if r == "inf" else r for r in ranks),
                                                                    reverse=True)
    fairness = out["fairness"][2]
    assert 0 < len(fairness["t"]) <= 50
    columns = ("max_rho", "p99_rho", "jain", "utilisation", "starving")
    assert all(len(fairness[k]) == len(fairness["t"]) for k in columns)
    assert len(fairness["gpus"]) == len(fairness["apps"]) + 1
    assert {e["kind"] for e in out["grants"][2]["events"]} == {"grant"}
    kinds = {e["kind"] for e in out["events"][2]["events"]}
    assert kinds <= set(out["index"][2]["event_kinds"])
    assert out["settings"][2]["settings"]["policy"] == "themis"
    assert out["app_rounds"][2]["rounds"][0]["rank"] is not None
    gone = out["gone_app"][2]  # every app has left by the end of the run; its page still reads
    assert gone["state"] == "gone" and gone["held"] == 0 and len(gone["rho_history"]) > 1
    for bad, word in (("bad_limit", "limit"), ("bad_at", "at"), ("bad_kind", "nonsense")):
        assert out[bad][0] == 400 and word in out[bad][2]["error"], out[bad]
    assert out["missing"][0] == 404 and "999999" in out["missing"][2]["error"]
    assert out["no_app"][0] == 404


def test_views_read_back_from_json_infinities_included():
    view = AppView("a", rho=math.inf, rho_wait=2.5, rho_history=((1.0, math.inf), (2.0, 3.0)))
    data = json.loads(json.dumps(to_json(view)))
    assert data["rho"] == "inf" and from_json(AppView, data) == view


def test_a_damaged_recording_is_refused_with_its_line(tmp_path):
    import gzip

    path = tmp_path / RECORDING
    with gzip.open(path, "wt") as f:
        f.write('{"op":"recording","version":1,"meta":{}}\n{"op":"round","round":{"round_id":"x","now":1}}\n')
    with pytest.raises(RecordingError, match=r"line 2: round.round_id: expected an integer"):
        load_recording(path)
    with pytest.raises(RecordingError, match="no such file"):
        load_recording(tmp_path / "nothing" / RECORDING)


def test_the_timeline_gives_back_the_map_of_any_kept_round():
    """The time slider's source: changes per round with a full copy every few rounds, trimmed in
    whole blocks, against the state remembered at each round."""
    import random

    rng = random.Random(5)
    source = MemorySource(rounds_kept=20, keyframe_every=4)
    gpus = [f"m{k}-g{j}" for k in range(4) for j in range(4)]
    source.set_layout(ClusterLayout("t", tuple(GpuPlace(g, "r0", g.split("-")[0], g) for g in gpus)))
    truth = {}
    held: dict[str, LeaseView] = {}
    for r in range(1, 60):
        changes = {}
        for g in rng.sample(gpus, 3):
            changes[g] = None if rng.random() < 0.3 else LeaseView(f"app{rng.randrange(5)}", r + 10.0, r, r)
            if changes[g] is None:
                held.pop(g, None)
            else:
                held[g] = changes[g]
        source.apply(float(r), changes, {})
        source.push_round(RoundView(r, float(r)))
        truth[r] = {g: (held[g].app if g in held else None) for g in gpus}
    kept = [rid for rid, _ in source.timeline().rounds]
    assert kept[-1] == 59 and 20 <= len(kept) < 28 and kept[0] > 1
    for r in kept:
        assert {g.id: g.holder for g in source.cluster(r).gpus} == truth[r]
    with pytest.raises(LookupError, match="not in the history"):
        source.cluster(1)


def test_a_subscriber_that_falls_behind_is_told_to_read_everything_again():
    async def main():
        source = MemorySource(queue_max=3)
        sub = source.subscribe()
        for k in range(10):
            source.push_round(RoundView(k + 1, float(k)))
        first = await sub.get()
        source.push_round(RoundView(11, 11.0))
        after = await sub.get()
        sub.close()
        return first, after, source.subscribers

    first, after, left = run(main())
    assert first.kind == "resync" and after.kind == "round" and json.loads(after.data)["round_id"] == 11
    assert left == 0


# -- access ----------------------------------------------------------------------------------------


def _tiny_source() -> MemorySource:
    source = MemorySource(title="tiny")
    source.set_layout(ClusterLayout("t", (GpuPlace("m0-g0", "r0", "m0", "m0-s0"),)))
    source.set_settings({"policy": "themis", "admin_token": "never-shown", "lease_s": 600.0})
    return source


def test_off_loopback_needs_a_verifier_and_loopback_is_named_right():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")
    with pytest.raises(ValueError, match="off loopback"):
        run(start("0.0.0.0", 0, _tiny_source()))
    assert shown_settings({"admin_token": "x", "lottery_secret": "y", "lease_s": 1}) == {"lease_s": 1}


def test_a_revoked_or_unknown_viewer_token_is_refused_and_a_good_one_never_shown(tmp_path):
    store = Store(tmp_path / "arbiter.db")
    token = issue_viewer_token(store, "alice")
    other = issue_viewer_token(store, "bob")
    source = _tiny_source()

    async def main():
        dashboard = await start("127.0.0.1", 0, source, verify=store_verifier(store), require_token=True)
        url, out = dashboard.url, {}
        try:
            async with aiohttp.ClientSession() as http:
                async def status(path, **kw):
                    async with http.get(url + path, allow_redirects=False, **kw) as reply:
                        return reply.status, await reply.text(), reply.headers

                out["none"] = await status("api/v1/cluster")
                out["unknown"] = await status("api/v1/cluster", headers={"Authorization": "Bearer view_nope"})
                out["bearer"] = await status("api/v1/cluster", headers={"Authorization": f"Bearer {token}"})
                out["page_none"] = await status("")
                out["once"] = await status(f"?token={token}")
            async with browser_page() as page:
                await page.goto(f"{url}?token={token}#/settings")
                await page.wait_for_selector("#settings-table tr", state="attached")
                out["landed"] = page.url
                out["cookie_js"] = await page.evaluate("document.cookie")
                out["html"] = await page.content()
                cookies = await page.context.cookies()
                out["cookie"] = next(c for c in cookies if c["name"] == "themis_viewer")
                assert store.revoke_viewer("alice") == 1
                reply = await page.reload()
                out["after_revoke"] = (reply.status, await page.content())
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "api/v1/cluster", headers={"Authorization": f"Bearer {token}"}) as reply:
                    out["revoked_bearer"] = reply.status
                async with http.get(url + "api/v1/cluster", headers={"Authorization": f"Bearer {other}"}) as reply:
                    out["other"] = reply.status
        finally:
            await dashboard.stop()
        return out

    out = run(main())
    store.close()
    assert out["none"][0] == 401 and "viewer token is required" in out["none"][1]
    assert out["unknown"][0] == 401 and "view_nope" not in out["unknown"][1]
    assert out["bearer"][0] == 200
    assert out["page_none"][0] == 401
    status, body, headers = out["once"]
    assert status == 303 and token not in headers["Location"] and token not in body
    assert "HttpOnly" in headers["Set-Cookie"] and "SameSite=Strict" in headers["Set-Cookie"]
    assert "token=" not in out["landed"] and token not in out["landed"]
    assert token not in out["cookie_js"], "the cookie must be HttpOnly"
    assert token not in out["html"] and "never-shown" not in out["html"] and "admin_token" not in out["html"]
    assert out["cookie"]["httpOnly"] and out["cookie"]["value"] == token
    assert out["after_revoke"][0] == 401 and token not in out["after_revoke"][1]
    assert out["revoked_bearer"] == 401 and out["other"] == 200


def test_the_dashboard_speaks_tls_with_the_arbiters_certificate(tmp_path):
    if shutil.which("openssl") is None:
        raise AssertionError("the openssl CLI is needed to make a test certificate")
    cert, key = tmp_path / "c.crt", tmp_path / "c.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    with pytest.raises(ValueError, match="cannot serve TLS"):
        tls_context(key, cert)

    async def main():
        dashboard = await start("127.0.0.1", 0, _tiny_source(), ssl_context=tls_context(cert, key),
                                verify=fixed_verifier({"view_t": "t"}), require_token=True)
        try:
            trust = ssl.create_default_context(cafile=str(cert))
            async with aiohttp.ClientSession() as http:
                async with http.get(dashboard.url + "?token=view_t", ssl=trust, allow_redirects=False) as reply:
                    cookie = reply.headers["Set-Cookie"]
                async with http.get(dashboard.url + "api/v1/cluster", ssl=trust,
                                    headers={"Authorization": "Bearer view_t"}) as reply:
                    body = await reply.json()
            with pytest.raises(aiohttp.ClientError):
                async with aiohttp.ClientSession() as http:
                    async with http.get(dashboard.url.replace("https", "http") + "api/v1/cluster"):
                        pass
            return dashboard.url, cookie, body
        finally:
            await dashboard.stop()

    url, cookie, body = run(main())
    assert url.startswith("https://") and "Secure" in cookie and body["name"] == "t"


# -- live --------------------------------------------------------------------------------------------


HELD_BY = "([gpus, app]) => gpus.every(g => document.querySelector(`.gpu[data-g='${g}']`)?.dataset.app === app)"
CELLS = "r => Array.from(r.cells).map(c => c.textContent)"
CLUSTER_8 = {"name": "live-8", "racks": [{"name": "r0", "machines": [{"gpus": 4, "slots": 2, "count": 2}]}]}


def test_a_grant_pushed_live_shows_on_the_map_and_in_the_apps(tmp_path):
    """A real round engine with real in-process agents, fed to the page through a MemorySource by
    EngineFeed in the server's own event loop; the page learns of the grant over its live stream."""
    cluster = cluster_from_mapping(CLUSTER_8)
    engine = RoundEngine(cluster, make_policy("themis"), lease_s=600.0)
    source = MemorySource(title="live test")
    feed = EngineFeed(source, engine, model_of=lambda app: "resnet50")
    feed.start({"policy": "themis", "lease_s": 600.0, "admin_token": "never-shown"})

    async def main():
        dashboard = await start("127.0.0.1", 0, source, keepalive_s=0.5)
        try:
            async with browser_page() as page:
                await page.goto(dashboard.url + "#/cluster")
                await page.wait_for_selector("html[data-painted]", state="attached")
                await page.wait_for_function("document.getElementById('status').textContent === 'live'")
                assert await page.eval_on_selector_all(".gpu[data-app]", "cells => cells.length") == 0
                now = time.time()
                app = SuccessiveHalvingApp([10.0, 11.0, 12.0, 13.0], [1000.0, 2000.0], job_demand_max=1,
                                           slowdown=(1.0, 1.1, 1.5, 2.0))
                app.start_time = now
                engine.add_app("search-a", now)
                feed.sync(now)
                result = engine.run_round(now, {"search-a": Agent(app, name="search-a")})
                feed.after_round(result)
                granted = sorted(g for grant in result.grants for g in grant.gpus)
                assert granted, "the round granted nothing"
                await page.wait_for_function(HELD_BY, arg=[granted, "search-a"])
                summary = await page.text_content("#summary")
                await page.goto(dashboard.url + "#/apps")
                await page.wait_for_selector("#apps-table tbody tr", state="attached")
                row = await page.eval_on_selector("#apps-table tbody tr", CELLS)
                await page.goto(dashboard.url + f"#/rounds/{result.round_id}")
                await page.wait_for_selector(f"html[data-round='{result.round_id}']", state="attached")
                placed = await page.text_content("#round-placed")
                return granted, summary, row, placed
        finally:
            await dashboard.stop()

    granted, summary, row, placed = run(main())
    assert summary.startswith(f"8 GPUs, {len(granted)} leased")
    assert row[0] == "search-a" and row[6] == str(len(granted)) and row[1] == "resnet50"
    assert "search-a" in placed and "auction" in placed
