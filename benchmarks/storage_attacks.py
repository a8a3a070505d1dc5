"""The attacks of docs/reliability.md ("Attacks on the journal, recovery and export, before and after"), scaled
to the tiny model, each against a real worker process: a damaged journal row and a lost WAL
file (recovery), a run that never steps under a storage budget (budget), padded PyTRIO events sent together under
two parse budgets (events), and an xz archive bomb given to the export command (export). One JSON line each.

    python benchmarks/storage_attacks.py [recovery] [budget] [events] [export]
"""

import io, json, os, sqlite3, subprocess, sys, tarfile, tempfile, threading, time  # noqa: E401
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "pytrio")]
import httpx  # noqa: E402
import msgpack  # noqa: E402
from pytrio_raw import RawClient, envelope  # noqa: E402
from support import WorkerProcess  # noqa: E402

from server_mock.engine.tiny_model import make_tiny_model  # noqa: E402

root = Path(tempfile.mkdtemp(prefix="measure-"))
model = make_tiny_model(root / "model")
A, B = "key-a", "key-b"
MiB = 1 << 20


def du(p):
    return sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())


def rss(pid):
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Health(threading.Thread):
    def __init__(self, base):
        super().__init__(daemon=True)
        self.base, self.times, self.stop = base, [], False

    def run(self):
        with httpx.Client(base_url=self.base, timeout=30) as h:
            while not self.stop:
                t = time.perf_counter()
                h.get("/v1/health")
                self.times.append(time.perf_counter() - t)
                time.sleep(0.01)

    def done(self):
        self.stop = True
        self.join()
        ts = sorted(self.times)
        return {
            "p50_ms": round(ts[len(ts) // 2] * 1e3, 1),
            "p95_ms": round(ts[int(len(ts) * 0.95)] * 1e3, 1),
            "max_ms": round(ts[-1] * 1e3, 1),
            "n": len(ts),
        }


def out(name, **kw):
    print(json.dumps({"attack": name, **kw}), flush=True)


# --- padded events -------------------------------------------------------------------------------------
def padded_events(size_mib, parsing_mib):
    st = root / f"events-{size_mib}-{parsing_mib}"
    st.mkdir()
    w = WorkerProcess(model, st / "storage", "--max-parsing-bytes", str(parsing_mib * MiB), api_keys=[A, B]).start()
    try:
        raw = RawClient(w.base_url, A)
        s = raw.session()
        runs = [raw.training_run(s) for _ in range(4)]
        bodies = []
        for r in runs:
            env = envelope(
                "trainer.init_run",
                {
                    "base_model": str(model.resolve()),
                    "lora_config": {"rank": 2, "train_mlp": True, "train_attn": True, "train_unembed": True},
                },
                1,
                r.cuid,
            )
            n = size_mib * MiB // 9  # many small strings in an ignored key, as in the report (arrays of 200000)
            env["pad1"] = [[("x%07d" % i) for i in range(j, min(n, j + 200000))] for j in range(0, n, 200000)]
            bodies.append(msgpack.packb(env, use_bin_type=True))
        before_db, base_rss = du(st / "storage" / "durable"), rss(w.process.pid)
        peak = [base_rss]
        stop = [False]

        def watch():
            while not stop[0]:
                peak[0] = max(peak[0], rss(w.process.pid))
                time.sleep(0.005)

        wt = threading.Thread(target=watch, daemon=True)
        wt.start()
        health = Health(w.base_url)
        health.start()
        time.sleep(0.3)
        t = time.perf_counter()
        res = [None] * 4

        def send(i):
            with httpx.Client(base_url=w.base_url, timeout=120) as c:
                res[i] = c.post("/pytrio-actor/v1/events", content=bodies[i], headers=runs[i].headers())

        ths = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        [x.start() for x in ths]
        [x.join() for x in ths]
        took = time.perf_counter() - t
        time.sleep(0.3)
        h = health.done()
        stop[0] = True
        wt.join()
        out(
            "padded_events",
            body_mib=round(len(bodies[0]) / MiB, 1),
            parsing_mib=parsing_mib,
            statuses=[r.status_code for r in res],
            message=res[0].json().get("message", "")[:90] if res[0].status_code == 400 else "",
            seconds=round(took, 2),
            durable_growth_bytes=du(st / "storage" / "durable") - before_db,
            rss_peak_growth_mib=round((peak[0] - base_rss) / MiB),
            health_b=h,
        )
    finally:
        w.stop()


# --- a run that never steps, with a storage budget ---------------------------------------------------------
def never_steps():
    from pytrio_compat.types.tensor import WireTensor
    import numpy as np

    st = root / "budget"
    st.mkdir()
    w = WorkerProcess(model, st / "storage", "--max-storage-bytes-per-tenant", "1000000", api_keys=[A, B]).start()
    try:
        a = httpx.Client(base_url=w.base_url, timeout=120, headers={"X-API-Key": A})
        run = a.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}}).json()["training_run_id"]
        before = du(st / "storage" / "durable")

        def datum(o):
            ids = np.asarray([(7 * i + o) % 480 + 10 for i in range(2000)], dtype=np.int64)
            return {
                "tokens": WireTensor.from_array(ids[:-1]).model_dump(),
                "loss_fn_inputs": {"target_tokens": WireTensor.from_array(ids[1:]).model_dump()},
            }

        codes = []
        for seq in range(1, 25):
            r = a.post(
                f"/v1/training_runs/{run}/ops",
                json={
                    "seq_id": len([c for c in codes if c == 200]) + 1,
                    "payload": {
                        "op": "forward_backward",
                        "loss_fn": "cross_entropy",
                        "data": [datum(seq * 16 + k) for k in range(16)],
                    },
                },
            )
            codes.append(r.status_code)
            if r.status_code != 200:
                last = r.json()
                break
        time.sleep(2)
        out(
            "never_steps",
            ops_sent=len(codes),
            accepted=codes.count(200),
            refused=codes[-1],
            code=last.get("code") if codes[-1] != 200 else None,
            durable_growth_mib=round((du(st / "storage" / "durable") - before) / MiB, 2),
        )
    finally:
        w.stop()


# --- a damaged row ------------------------------------------------------------------------------------------
def damaged_row():
    st = root / "recovery"
    st.mkdir()
    w = WorkerProcess(model, st / "storage", api_keys=[A, B]).start()
    a = httpx.Client(base_url=w.base_url, timeout=60, headers={"X-API-Key": A})
    bad, good = [
        a.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}}).json()["training_run_id"]
        for _ in range(2)
    ]
    raw = RawClient(w.base_url, A)
    s = raw.session()
    pr = raw.training_run(s)
    w.kill()
    with sqlite3.connect(st / "storage" / "durable" / "state.db") as db:
        db.execute('UPDATE runs SET spec = \'{"rank": "x"}\' WHERE run_id = ?', (bad,))
        db.execute(
            "UPDATE records SET value = '{\"session\": ' WHERE namespace = 'pytrio.training_run' AND key = ?",
            (pr.cuid,),
        )
    t = time.perf_counter()
    try:
        w = WorkerProcess(model, st / "storage", api_keys=[A, B]).start(w.port)
        started = round(time.perf_counter() - t, 2)
        a = httpx.Client(base_url=w.base_url, timeout=60, headers={"X-API-Key": A})
        out(
            "damaged_row",
            started=True,
            serving_after_s=started,
            kept=a.get(f"/v1/training_runs/{good}").status_code,
            damaged=a.get(f"/v1/training_runs/{bad}").status_code,
            pytrio_damaged=a.get(f"/api/openapi/v1/training-runs/{pr.cuid}").status_code,
        )
        w.kill()
    except RuntimeError as exc:
        out("damaged_row", started=False, error=str(exc)[-200:])
    # lost WAL after kill -9
    st2 = root / "lost-wal"
    st2.mkdir()
    w = WorkerProcess(model, st2 / "storage", api_keys=[A, B]).start()
    a = httpx.Client(base_url=w.base_url, timeout=60, headers={"X-API-Key": A})
    a.post("/v1/training_runs", json={"base_model": "tiny", "lora": {"rank": 4}})
    w.kill()
    (st2 / "storage" / "durable" / "state.db-wal").unlink(missing_ok=True)
    w = WorkerProcess(model, st2 / "storage", api_keys=[A, B]).start(w.port)
    w.stop()
    log = (st2 / "worker.log").read_text()
    out("lost_wal", warned="THE JOURNAL IS EMPTY" in log)


# --- export bomb and hostile files ----------------------------------------------------------------------------
def export_bomb():
    st = root / "export"
    st.mkdir()
    bomb = st / "bomb.tar.xz"
    with tarfile.open(bomb, "w:xz", preset=0) as tar:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = 64 * MiB
        tar.addfile(info, io.BytesIO(bytes(64 * MiB)))
    tmp = st / "tmp"
    tmp.mkdir()
    t = time.perf_counter()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytrio_compat.cli",
            "export",
            str(bomb),
            "--base",
            str(model),
            "--merged",
            str(st / "m"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)},
    )
    out(
        "export_bomb",
        bomb_kib=bomb.stat().st_size // 1024,
        unpacked_mib=64,
        rc=p.returncode,
        seconds=round(time.perf_counter() - t, 2),
        tmp_written_bytes=du(tmp),
        stderr=p.stderr.strip()[-160:],
    )


which = sys.argv[1:] or ["events", "budget", "recovery", "export"]
if "events" in which:
    padded_events(8, 32)  # 4 x 8 MiB within a 32 MiB budget: they decode together (as all did before)
    padded_events(8, 8)  # the budget of one: they decode one after another
if "budget" in which:
    never_steps()
if "recovery" in which:
    damaged_row()
if "export" in which:
    export_bomb()
