"""`opsched tune --storage postgresql://...` against a real PostgreSQL server: a throw-away cluster on
127.0.0.1 made with the installed binaries (initdb, pg_ctl), two concurrent workers, and a worker killed
with SIGKILL mid-trial whose trial is failed through Optuna's heartbeat and retried."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_tune import CODE
from test_tune import TINY_SETTINGS as TINY

optuna = pytest.importorskip("optuna")
pytest.importorskip("psycopg", reason="PostgreSQL tests need psycopg (the [cluster] extra)")

pytestmark = pytest.mark.slow


def _pg_bindir() -> Path | None:
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name), reverse=True):
        if (Path(d) / "initdb").exists() and (Path(d) / "pg_ctl").exists():
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL cluster of its own on 127.0.0.1 (a free port, a temporary data directory, trust auth
    for a test role); stopped and deleted by the finalizer.  initdb refuses to run as root: as root the
    server runs as the ``postgres`` system user that Debian's package made."""
    bindir = _pg_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) installed")
    uid = gid = None
    if os.geteuid() == 0:
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run the PostgreSQL server")
        uid, gid = pw.pw_uid, pw.pw_gid

    def demote() -> None:
        if uid is not None:
            os.setgid(gid)
            os.setuid(uid)

    root = Path(tempfile.mkdtemp(prefix="opsched-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if uid is not None:
        for p in (root, sock):
            os.chown(p, uid, gid)
    port = _free_port()

    def run(*args: str) -> None:
        out = subprocess.run([str(bindir / args[0]), *args[1:]], capture_output=True, text=True, preexec_fn=demote,
                             cwd=root, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed: {out.stdout[-1500:]} {out.stderr[-1500:]}")

    run("initdb", "-D", str(data), "-U", "opsched", "--auth=trust", "-E", "UTF8", "--no-sync")
    opts = f"-c listen_addresses=127.0.0.1 -p {port} -k {sock} -c fsync=off -c full_page_writes=off"
    try:
        run("pg_ctl", "-D", str(data), "-o", opts, "-l", str(root / "server.log"), "-w", "-t", "60", "start")
        run("createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "opsched", "opsched_test")
        yield f"postgresql://opsched@127.0.0.1:{port}/opsched_test"
    finally:
        try:
            run("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        except RuntimeError:
            pass
        shutil.rmtree(root, ignore_errors=True)


def _worker(out: Path, storage: str, study: str, n_trials: int, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-c", CODE, "tune", "--study", study, "--storage", storage,
            "--n-trials", str(n_trials), "--out", str(out), *TINY, *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _load(storage: str, study: str):
    from opsched.agents.tune import make_storage

    return optuna.load_study(study_name=study, storage=make_storage(storage, "."))


def test_two_workers_share_a_study_on_postgresql_and_the_cap_is_exact(postgres, tmp_path):
    procs = [_worker(tmp_path, postgres, "pair", 4, "--timesteps", "64") for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    trials = _load(postgres, "pair").get_trials(deepcopy=False)
    counted = [t for t in trials if not t.user_attrs.get("over_cap")]
    assert len(counted) == 4                                             # the cap, exactly
    assert sorted(t.number for t in trials) == list(range(len(trials)))  # none lost, none numbered twice
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for t in counted)
    runs = [t.user_attrs["run"] for t in counted]
    assert len(set(runs)) == 4 and all(Path(r).is_dir() for r in runs)  # each trained once, by one worker
    assert len({t.user_attrs["worker"] for t in counted}) == 2           # both workers trained


def test_a_killed_worker_s_trial_fails_by_heartbeat_and_is_retried(postgres, tmp_path):
    """Worker A is killed with SIGKILL while it trains; worker B, started with it, finishes its own trials,
    waits, sees A's trial miss its heartbeat, fails it, trains its retry (same parameters): the study ends
    with exactly the cap of trials done and none lost."""
    study, n = "killed", 3
    a = _worker(tmp_path, postgres, study, n, "--timesteps", "512", "--heartbeat", "1")
    b = _worker(tmp_path, postgres, study, n, "--timesteps", "64", "--heartbeat", "1")
    victim = None
    deadline = time.monotonic() + 120
    while victim is None and time.monotonic() < deadline:
        time.sleep(0.3)
        try:
            trials = _load(postgres, study).get_trials(deepcopy=False)
        except KeyError:  # the study is not created yet
            continue
        for t in trials:
            if t.state == optuna.trial.TrialState.RUNNING and t.user_attrs.get("worker", "").endswith(f":{a.pid}"):
                if list(tmp_path.glob(f"{study}_t{t.number}_*/checkpoints/step_0.json")):  # it is training
                    victim = t
    assert victim is not None, "worker A never got to train a trial"
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=30)
    out_b = b.communicate(timeout=300)[0]
    assert b.returncode == 0, out_b
    assert f"retrying trial {victim.number}" in out_b

    trials = {t.number: t for t in _load(postgres, study).get_trials(deepcopy=False)}
    failed = trials[victim.number]
    assert failed.state == optuna.trial.TrialState.FAIL                  # marked failed through the heartbeat
    (retry,) = [t for t in trials.values() if t.system_attrs.get("failed_trial") == victim.number]
    assert retry.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    assert retry.params == failed.params and retry.user_attrs["worker"].endswith(f":{b.pid}")
    retried = {victim.number}
    counted = [t for t in trials.values() if not t.user_attrs.get("over_cap") and t.number not in retried]
    assert len(counted) == n                                             # the cap holds, the retry in its place
    assert all(t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED) for t in counted)
    assert sorted(trials) == list(range(len(trials)))
    # the study resumes: another worker finds nothing left to do
    c = _worker(tmp_path, postgres, study, n, "--timesteps", "64", "--heartbeat", "1")
    out_c = c.communicate(timeout=120)[0]
    assert c.returncode == 0 and "trained trial(s) none" in out_c, out_c
