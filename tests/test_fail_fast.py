"""Fail fast, with the reason (issue 11, item 3): a search whose runs keep failing stops with the first
failure's log; a command given as a string is refused at once; a typo in an app file is named."""

from __future__ import annotations

import asyncio
import statistics
import sys
from pathlib import Path

import pytest

from agent.agent import Agent
from agent.app_config import AppConfigError, app_from_mapping, load_app
from agent.client import AgentClient
from agent.launcher import Launcher
from agent.runner import AppRunner, SearchFailed
from agent.trial import TrialSpec
from hyperparam_adapters.curve_stopping import CurveStoppingAdapter
from hyperparam_adapters.hyperband import HyperbandAdapter, SuccessiveHalvingAdapter
from tests.service_kit import arbiter, credential, target, wait_for

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]
CRASH = "import sys\nprint('loading data from /nowhere/train.csv')\nraise FileNotFoundError('/nowhere/train.csv')\n"


def test_a_crashing_training_script_stops_the_search_with_its_error(tmp_path):
    crash = tmp_path / "train.py"
    crash.write_text(CRASH)

    async def scenario():
        async with arbiter(tmp_path) as server:
            adapter = HyperbandAdapter({"lr": [0.1, 0.01]}, max_resource=9, eta=3, iter_time=0.05)
            client = AgentClient(Agent(adapter), "crashy", target(server), await credential(server, "crashy"),
                                 backoff_s=(0.05, 0.5))
            launcher = Launcher("crashy", [PY, str(crash)], tmp_path / "w", cluster="test-8", grace_s=2.0)
            runner = AppRunner(adapter, client, launcher, max_failures=2, max_failed_runs=4, quiet=True)
            with pytest.raises(SearchFailed) as caught:
                await runner.run(timeout=60)
            # issue 36: the failed search left the arbiter (it used to stay registered with its
            # demand, counted in every app's N_avg, until an admin removed it)
            await wait_for(lambda: "crashy" not in server.service.engine.apps, 10)
            assert client.finished and not any(x.app == "crashy" for x in server.service.engine.leases)
            return runner, caught.value

    runner, error = asyncio.run(asyncio.wait_for(scenario(), 90))
    # without the bound: 9 trials x 2 tries, and the search "finishes" with no result; with it: one
    # wave of starts on the 8 GPUs at most (several may fail in the same poll), then the error
    assert error.runs >= 4 and sum(runner.launcher.starts.values()) <= 8
    # runs still starting when the search stops are stopped by the runner (on a busy machine some
    # are); every run that ended on its own crashed with the script's exit code
    crashed = [e for e in runner.launcher.history if not e.requested]
    assert len(crashed) >= 4 and all(e.returncode == 1 for e in crashed), runner.launcher.history
    assert "FileNotFoundError: /nowhere/train.csv" in str(error) and "exit code 1" in str(error)
    assert error.job in runner.launcher.starts and not runner.launcher.live()  # nothing left running


def test_a_command_whose_program_does_not_exist_fails_the_search_instead_of_retrying_forever(tmp_path):
    """A typo in the program (``pyhton3``) is the job's fault, not the engine's: it counts towards
    the fail-fast bound. It used to be a LaunchError, retried every 30 s uncounted while the app
    held its GPUs and ran nothing on them."""

    async def scenario():
        async with arbiter(tmp_path) as server:
            adapter = HyperbandAdapter({"lr": [0.1, 0.01]}, max_resource=9, eta=3, iter_time=0.05)
            client = AgentClient(Agent(adapter), "typo", target(server), await credential(server, "typo"),
                                 backoff_s=(0.05, 0.5))
            launcher = Launcher("typo", ["pyhton3-no-such-program", "train.py"], tmp_path / "w", cluster="test-8",
                                grace_s=2.0)
            runner = AppRunner(adapter, client, launcher, max_failures=2, max_failed_runs=3, quiet=True)
            with pytest.raises(SearchFailed) as caught:
                await runner.run(timeout=60)
            return runner, caught.value

    runner, error = asyncio.run(asyncio.wait_for(scenario(), 90))
    assert "cannot start 'pyhton3-no-such-program'" in str(error) and "No such file" in str(error)
    assert error.runs >= 3 and not runner._launch_errors  # counted as failures, not engine retries


def test_a_search_whose_jobs_report_is_not_stopped_by_a_few_failures(tmp_path):
    """The bound counts failures with no report in between: one job reporting resets it."""
    flaky = tmp_path / "train.py"
    flaky.write_text("import sys\nfrom agent.job import Job\njob = Job.from_env()\n"
                     "if job.params['lr'] == 0.1:\n    raise SystemExit(2)\n"
                     "state = job.resume() or {'it': 0}\nit = state['it']\n"
                     "while not job.step(it + 1, 1.0 / (it + 1)):\n    it += 1\njob.save({'it': it + 1})\n")

    async def scenario():
        async with arbiter(tmp_path) as server:
            adapter = HyperbandAdapter({"lr": [0.1, 0.01]}, max_resource=3, eta=3, iter_time=0.05, seed=1)
            client = AgentClient(Agent(adapter), "flaky", target(server), await credential(server, "flaky"),
                                 backoff_s=(0.05, 0.5))
            launcher = Launcher("flaky", [PY, str(flaky)], tmp_path / "w", cluster="test-8", grace_s=2.0,
                                env={"PYTHONPATH": str(ROOT)})
            runner = AppRunner(adapter, client, launcher, max_failures=1, max_failed_runs=3, quiet=True)
            await runner.run(timeout=60)
            return runner, adapter

    runner, adapter = asyncio.run(asyncio.wait_for(scenario(), 90))
    assert runner.finished and runner.failed and adapter.best() is not None
    assert adapter.best().params["lr"] == 0.01


def test_a_command_given_as_a_string_is_refused_at_once(tmp_path):
    refused = r"list of arguments, not the string 'python train.py'.*\['python', 'train.py'\]"
    with pytest.raises(TypeError, match=refused):
        Launcher("a", "python train.py", tmp_path)
    launcher = Launcher("a", lambda spec: f"python train.py --lr {spec.params['lr']}", tmp_path)
    with pytest.raises(TypeError, match="list of arguments"):
        launcher.start(TrialSpec("t1", {"lr": 0.1}), ["r0-m0-g0"])
    assert not launcher.live() and not launcher.starts


def test_a_command_given_as_a_path_or_empty_is_refused_at_once(tmp_path):
    """A path (``HERE / "train.py"``) passed as the command was accepted, and the first start, once
    the agent had registered and won GPUs, failed the search with "'PosixPath' object is not
    iterable" from inside the launcher; an empty list failed every start as the job's own failure."""
    train = tmp_path / "train.py"
    with pytest.raises(TypeError, match=r"list of arguments, not the path '.*train.py'.*\[sys.executable, '.*train.py'\]"):
        Launcher("a", train, tmp_path)
    with pytest.raises(ValueError, match="the training command is empty"):
        Launcher("a", [], tmp_path)
    launcher = Launcher("a", lambda spec: train, tmp_path)
    with pytest.raises(TypeError, match="list of arguments, not the path"):
        launcher.start(TrialSpec("t1", {"lr": 0.1}), ["r0-m0-g0"])
    assert not launcher.live() and not launcher.starts
    adapter = HyperbandAdapter({"lr": [0.1]}, max_resource=3, eta=3, iter_time=0.05)
    with pytest.raises(TypeError, match="list of arguments, not the path"):
        asyncio.run(AppRunner.create(adapter, train, app="a", arbiter="127.0.0.1:9", workdir=str(tmp_path / "w"),
                                     credential="c"))
    assert not (tmp_path / "w").exists()  # refused before a run of the search began


APP = {"app": {"kind": "successive_halving", "iter_times": [1, 2], "iterations": [2, 4]},
       "context": {"cluster_size": 4}}


@pytest.mark.parametrize("table, key, hint", [
    ("app", "iter_time", "iter_times"),
    ("app", "job_demand", "job_demand_max"),
    ("context", "navg", "n_avg"),
    (None, "contxt", "context"),
])
def test_a_typo_in_an_app_file_names_the_key_and_the_file(tmp_path, table, key, hint):
    text = ('[app]\nkind = "successive_halving"\niter_times = [1, 2]\niterations = [2, 4]\n'
            '[context]\ncluster_size = 4\n')
    if table is None:
        text += f"[{key}]\nx = 1\n"
    else:
        text = text.replace(f"[{table}]\n", f"[{table}]\n{key} = 3\n")
    path = tmp_path / "search.toml"
    path.write_text(text)
    with pytest.raises(AppConfigError) as caught:
        load_app(path)
    message = str(caught.value)
    assert str(path) in message and f"unknown key '{key}'" in message and f"did you mean '{hint}'" in message


def test_a_correct_app_file_still_loads():
    app, ctx = app_from_mapping(APP, "inline")
    assert ctx.cluster_size == 4 and app.num_phases() == 2


@pytest.mark.parametrize("content, error", [
    (b'[app]\nkind = ["single_job"]\niterations = 10\niter_time = 1\n[context]\ncluster_size = 4\n',
     "app.kind must be 'successive_halving' or 'single_job', got ['single_job']"),
    (b"\xff\xfe\x00binary", "not UTF-8 text (byte 0)"),
    (b'[app]\nkind = "single_job"\niterations = 10\niter_time = 1\nslowdown = [3, 2, 1, 1]\n'
     b'[context]\ncluster_size = 4\n', "app.slowdown must not decrease from slot to cluster"),
])
def test_a_malformed_app_file_is_refused_with_a_message_not_a_traceback(tmp_path, content, error):
    """A list where a string belongs was a TypeError, a binary file a UnicodeDecodeError, and a
    slowdown that falls with the level (against D1) was accepted and made spread rows look best."""
    path = tmp_path / "search.toml"
    path.write_bytes(content)
    with pytest.raises(AppConfigError) as caught:
        load_app(path)
    assert str(path) in str(caught.value) and error in str(caught.value)


def test_the_agent_cli_checks_its_options_before_spending_the_one_time_token(tmp_path, capsys):
    """``--speedup 0`` used to fail after registering: the token was spent and the credential lost.
    A missing ``--tls-ca`` file was a FileNotFoundError traceback."""
    from agent.cli import main

    app = tmp_path / "a.toml"
    app.write_text('[app]\nkind = "single_job"\niterations = 10\niter_time = 1\n[context]\ncluster_size = 4\n')
    base = ["run", str(app), "--arbiter", "127.0.0.1:9", "--token", "t", "--workdir", str(tmp_path / "w")]
    assert main([*base, "--speedup", "0"]) == 2
    assert "--speedup must be a positive number" in capsys.readouterr().err
    assert main([*base, "--tls-ca", str(tmp_path / "missing.pem")]) == 2
    assert "--tls-ca" in (err := capsys.readouterr().err) and "missing.pem" in err


def test_an_empty_credential_file_means_no_credential_and_keeping_one_is_atomic(tmp_path):
    """An empty file (a crash between create and write) used to be the credential "", so the token
    given with it was ignored and the agent refused."""
    from agent.credential import CredentialFileError, keep_credential, read_credential

    path = tmp_path / "cred"
    assert read_credential(path) is None
    path.write_text("\n")
    assert read_credential(path) is None
    keep_credential(path, "c-123")
    assert read_credential(path) == "c-123" and path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["cred"]  # no temporary file left
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(CredentialFileError, match="cannot read the credential file"):
        read_credential(path)


def test_a_bad_argument_to_create_leaves_no_broker_connection_open(tmp_path):
    """AppRunner.create started the metrics bus before checking the launcher's and the runner's
    arguments, so every refused call left an MQTT connection (and its task) behind."""
    from tests.test_events import Broker

    broker = Broker(tmp_path)
    broker.start()

    async def scenario():
        before = set(asyncio.all_tasks())
        for bad in ({"grace_s": -1.0}, {"max_failed_runs": 0}):
            adapter = HyperbandAdapter({"lr": [0.1]}, max_resource=3, eta=3, iter_time=0.05)
            with pytest.raises(ValueError):
                await AppRunner.create(adapter, [PY, "train.py"], app="a", arbiter="127.0.0.1:9",
                                       workdir=str(tmp_path / "w"), credential="c", mqtt=broker.url, **bad)
        await asyncio.sleep(0)
        return [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()]

    try:
        left = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        broker.stop()
    assert left == []


def _run_crashing_trials(tmp_path, app: str, adapter) -> AppRunner:
    """``adapter``'s search run to its end against a real arbiter, each trial's job crashing at once
    when its params say ``crash``, else training to its target; a job is given up on at its first
    failure (``max_failures=1``)."""
    flaky = tmp_path / "train.py"
    flaky.write_text("from agent.job import Job\njob = Job.from_env()\n"
                     "if job.params['crash']:\n    raise SystemExit(4)\n"
                     "state = job.resume() or {'it': 0}\nit = state['it']\n"
                     "while not job.step(it + 1, 1.0 / (it + 1)):\n    it += 1\njob.save({'it': it + 1})\n")

    async def scenario():
        async with arbiter(tmp_path) as server:
            client = AgentClient(Agent(adapter), app, target(server), await credential(server, app),
                                 backoff_s=(0.05, 0.5))
            launcher = Launcher(app, [PY, str(flaky)], tmp_path / "w", cluster="test-8", grace_s=2.0,
                                env={"PYTHONPATH": str(ROOT)})
            runner = AppRunner(adapter, client, launcher, max_failures=1, quiet=True)
            await runner.run(timeout=40)
            return runner

    return asyncio.run(asyncio.wait_for(scenario(), 90))


def test_a_trial_given_up_is_never_kept_for_the_next_rung(tmp_path):
    """Successive halving keeps the best of each rung by loss. A trial the runner gave up on (it kept
    crashing) was told an infinite loss, so when fewer trials than the next rung keeps had a finite
    one it was kept, and the next rung waited for a job the runner would never start again: the
    search held its GPUs and hung."""
    crashes = iter([True, True, True, False])  # t0-t2 crash at once; the first rung keeps 2 of the 4
    adapter = SuccessiveHalvingAdapter(lambda rng: {"crash": next(crashes)}, n=4, eta=2, min_resource=1,
                                       iter_time=0.05)
    runner = _run_crashing_trials(tmp_path, "rungs", adapter)
    assert runner.finished and runner.failed == {"t0", "t1", "t2"}
    assert [adapter.status(t) for t in ("t0", "t1", "t2", "t3")] == ["stopped", "stopped", "stopped", "finished"]
    assert adapter.best().job_id == "t3" and adapter.best().iteration == 4  # it ran every rung alone


def test_a_curve_trial_given_up_counts_only_the_work_it_did(tmp_path):
    """The runner told the curve-stopping tuner a trial it gave up on had reached the iteration cap
    (with an infinite loss), so the tuner counted the cap's worth of work the trial never did in the
    app's budget B, which rho and the bids are built from."""
    crashes = iter([True, False])
    adapter = CurveStoppingAdapter(lambda rng: {"crash": next(crashes)}, max_trials=2, parallel=1,
                                   max_iterations=4, tolerance=0.01, iter_time=100.0)
    runner = _run_crashing_trials(tmp_path, "curves", adapter)
    assert runner.finished and runner.failed == {"c0"} and adapter.status("c1") == ("finished", "cap")
    assert adapter.status("c0")[0] == "stopped"
    c1 = [r.serial_s for r in runner.reports if r.job_id == "c1"]
    assert len(c1) == 4 and adapter.budget() == pytest.approx(4 * statistics.median(c1))  # c0 did nothing
