"""``make compose-smoke``: build the compose stack's cpu profile and run it for real.

Steps, each named in the failure line when it fails (with the failing container's log tail):

1. tools     docker.io and docker-compose from Debian if missing (root), mmdebstrap for the base;
2. daemon    a running engine, or ``dockerd`` started here (and stopped at the end, by its pid);
3. base      ``$BASE_IMAGE`` if set, else ``deploy/make-base-image.sh`` (Debian packages only);
4. inputs    deploy/build-inputs/: pip's CA bundle and torch's CPU wheel from pip's find-links;
5. build     ``docker-compose --profile cpu build`` (timed; the image's size read after);
6. up        vllm-cpu and the sidecar, ``depends_on: service_healthy`` as compose.yaml says;
7. job       a job submitted from the host over REST (the published port, the generated token);
8. train     the trainer service (``run --no-deps``, no arguments) trains what compose.yaml's
             config path says: ``TRAIN_CONFIG=run.yaml`` in the mounted ``CONFIG_DIR`` (the
             job's id, the run dir under /checkpoints, checkpoint cadence) and ``TRAIN_ARGS``
             (``--nproc 2``: two ranks), until the job is consumed; the checkpoints, final/ and
             metrics.jsonl are read from the bind-mounted host ``CHECKPOINT_DIR``, the run's
             summary (world size) from the trainer's output (:func:`train_verdict`);
9. stop      the stack stopped (clean stop = every container exited 0 or by SIGTERM), the spool
             volume's files counted before ``down -v``, then no container of the project left
             (:func:`stop_verdict`).

The verdicts are functions of what the run read, unit-tested in ``make test``
(``tests/unit/bench/test_compose_smoke_results.py``), so a change that breaks them (as the
typed REST client once did) fails there, not only in a run that takes minutes.

Writes ``bench/results/compose_cpu.json``. Not part of ``make test`` (an image build takes
minutes and downloads vllm-cpu's dependencies).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from connector.contract.rest import JobStatus  # noqa: E402
from connector.contract.spool import KEPT_NAMES  # noqa: E402
from connector.contract.rest_client import SidecarClient, SidecarError  # noqa: E402

DEPLOY = ROOT / "deploy"
INPUTS = DEPLOY / "build-inputs"
PROJECT = "hsstream-smoke"
CPU_SERVICES = ["vllm-cpu", "sidecar-cpu", "trainer-cpu"]


class StepFailed(Exception):
    def __init__(self, step: str, why: str, log: str = "") -> None:
        super().__init__(f"compose-smoke: step '{step}' failed: {why}" + (f"\n{log}" if log else ""))
        self.step = step


def sh(cmd: list[str], step: str, *, timeout: float = 600, check: bool = True, env: dict | None = None,
       capture: bool = True) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(cmd, capture_output=capture, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise StepFailed(step, f"{' '.join(cmd[:6])} … ran past {timeout:.0f} s") from e
    if check and p.returncode != 0:
        tail = "\n".join(((p.stdout or "") + (p.stderr or "")).splitlines()[-40:])
        raise StepFailed(step, f"{' '.join(cmd[:8])} … exited {p.returncode}", tail)
    return p


def ensure_tools() -> None:
    missing = [pkg for tool, pkg in (("dockerd", "docker.io"), ("docker-compose", "docker-compose"),
                                     ("mmdebstrap", "mmdebstrap")) if shutil.which(tool) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise StepFailed("tools", f"missing {', '.join(missing)} and not root: apt-get install {' '.join(missing)}")
    print(f"[tools] apt-get install {' '.join(missing)}", flush=True)
    sh(["apt-get", "update", "-qq"], "tools", timeout=300)
    sh(["apt-get", "install", "-y", "-qq", *missing], "tools", timeout=900,
       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def engine_up() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def start_daemon(logdir: Path) -> subprocess.Popen | None:
    """Start dockerd if none answers; the Popen to stop at the end, or None if one was running."""
    if engine_up():
        return None
    print("[daemon] no engine answers: starting dockerd (overlay2)", flush=True)
    log = open(logdir / "dockerd.log", "w")
    proc = subprocess.Popen(["dockerd", "--storage-driver", "overlay2"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StepFailed("daemon", f"dockerd exited {proc.returncode}", (logdir / "dockerd.log").read_text()[-3000:])
        if engine_up():
            return proc
        time.sleep(1)
    proc.terminate()
    raise StepFailed("daemon", "dockerd did not answer within 60 s", (logdir / "dockerd.log").read_text()[-3000:])


def stop_daemon(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def pip_config() -> dict[str, str]:
    p = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    out: dict[str, str] = {}
    for line in p.stdout.splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            out[k.split(".", 1)[-1]] = v.strip().strip("'\"")
    return out


def fill_build_inputs() -> dict:
    """pip's CA bundle and torch's CPU wheel into deploy/build-inputs/ (git-ignored)."""
    conf = pip_config()
    got: dict = {"ca": None, "torch_wheel": None}
    cert = os.environ.get("PIP_CERT") or conf.get("cert")
    if cert and Path(cert).is_file():
        shutil.copyfile(cert, INPUTS / "ca.pem")
        got["ca"] = cert
    wheels = INPUTS / "wheels"
    wheels.mkdir(exist_ok=True)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in filter(None, (os.environ.get("PIP_FIND_LINKS") or conf.get("find-links", "")).split()):
        for whl in sorted(Path(folder).glob(f"torch-2.13.0+cpu-{tag}-*{platform.machine()}.whl")):
            dst = wheels / whl.name
            if not dst.exists():
                try:
                    os.link(whl, dst)
                except OSError:
                    shutil.copyfile(whl, dst)
            got["torch_wheel"] = str(whl)
    return got


def write_env(path: Path, token: str, base_image: str, port: int, vllm_port: int, *, checkpoints: Path,
              config: Path, train_config: str = "run.yaml", train_args: str = "--nproc 2") -> None:
    """deploy/.env.example with what the cpu profile needs: a real token, small spool, free ports,
    the trainer's host folders (checkpoints, its run file's) and its config path."""
    over = {
        "COMPOSE_PROFILES": "cpu", "COMPOSE_PROJECT_NAME": PROJECT, "HSSTREAM_IMAGE_TAG": "smoke",
        "HSSTREAM_API_TOKEN": token, "BASE_IMAGE": base_image, "SPOOL_SIZE": "1g",
        "HSSTREAM_SPOOL_BUDGET_BYTES": str(256 << 20), "HSSTREAM_PORT": str(port), "VLLM_PORT": str(vllm_port),
        "MODEL_DIR": str(DEPLOY),  # unused by the cpu services (the model is in the image); must be a path
        # vllm-cpu's grace before its healthcheck counts: on a 2-core host shared with other work
        # the tiny model took 10.5 min to load once, and `up` then failed on "unhealthy".
        "VLLM_START_PERIOD": "1800s",
        "CHECKPOINT_DIR": str(checkpoints), "CONFIG_DIR": str(config), "TRAIN_CONFIG": train_config,
        "TRAIN_ARGS": train_args,
    }  # fmt: skip
    lines = []
    for line in (DEPLOY / ".env.example").read_text().splitlines():
        key = line.split("=", 1)[0]
        if "=" in line and not line.startswith("#") and key in over:
            line = f"{key}={over.pop(key)}"
        lines.append(line)
    lines += [f"{k}={v}" for k, v in over.items()]
    path.write_text("\n".join(lines) + "\n")


def run_file(job: str, run: str = "smoke") -> dict:
    """The trainer's run file (``TRAIN_CONFIG``): the job to follow, where, how often to checkpoint."""
    return {"out_dir": f"/checkpoints/{run}", "jobs": [job], "checkpoint_every": 8, "warmup_steps": 4,
            "progress": False}  # fmt: skip


def last_json(text: str) -> dict | None:
    """The last JSON object printed on its own lines (the trainer's summary), or None."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("{"):
            try:
                return json.loads("\n".join(lines[i:]).rsplit("}", 1)[0] + "}")
            except ValueError:
                continue
    return None


def train_verdict(status: JobStatus, samples: int, run_dir: Path, summary: dict | None, nproc: int) -> tuple[dict, list[str]]:
    """What the train step found (for the result file) and what is wrong with it: the job done
    with every sample consumed once, checkpoints and final/ in the host folder ``run_dir``,
    metrics.jsonl's steps, the summary's world size equal to the ranks asked for."""
    metrics = run_dir / "metrics.jsonl"
    steps = [json.loads(x).get("step", 0) for x in (metrics.read_text().splitlines() if metrics.exists() else [])
             if x.strip().startswith("{")]  # fmt: skip
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").is_dir() else []
    got = {"job_counts": status.counts, "samples_consumed": int(status.counts.get("consumed", 0)),
           "train_steps": max(steps) if steps else 0, "checkpoints": ckpts,
           "final_draft": (run_dir / "final" / "config.json").is_file(),
           "world_size": (summary or {}).get("world_size"), "trainer_samples": (summary or {}).get("samples")}  # fmt: skip
    bad = []
    if not status.done:
        bad.append(f"job {status.job_id} not done: counts {status.counts}")
    if got["samples_consumed"] != samples:
        bad.append(f"{got['samples_consumed']} of {samples} samples consumed")
    if not ckpts or not got["final_draft"]:
        bad.append(f"checkpoints {ckpts}, final draft {'there' if got['final_draft'] else 'missing'} in {run_dir}")
    if not steps:
        bad.append(f"no step in {metrics}")
    if got["world_size"] != nproc:
        bad.append(f"the trainer ran {got['world_size']} rank(s), {nproc} asked for (summary {summary and list(summary)})")
    return got, bad


def stop_verdict(codes: dict[str, int], spool_files: int, containers_left: int, volumes_left: int) -> tuple[bool, list[str]]:
    """(clean stop: every container exited 0 or by SIGTERM, what else is wrong): a file left in
    the spool, a container or volume of the project left after ``down -v``."""
    clean = bool(codes) and all(c in (0, 143) for c in codes.values())
    bad = [] if clean else [f"exit codes {codes}"]
    if spool_files:
        bad.append(f"{spool_files} file(s) left in the spool")
    if containers_left or volumes_left:
        bad.append(f"containers left {containers_left}, volumes left {volumes_left}")
    return clean, bad


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=32, help="samples in the job submitted from the host")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "compose_cpu.json"))
    ap.add_argument("--keep-images", action="store_true", help="leave the built images in the engine")
    ap.add_argument("--cache", action="store_true", help="let the build reuse cached layers (build_s is then not a build's time)")
    ap.add_argument("--nproc", type=int, default=2, help="the trainer's ranks (TRAIN_ARGS=--nproc N)")
    args = ap.parse_args(argv)

    ensure_tools()
    work = Path(tempfile.mkdtemp(prefix="compose-smoke-"))
    daemon = start_daemon(work)
    env_file = work / "smoke.env"
    token = secrets.token_hex(32)
    port, vllm_port = free_port(), free_port()
    compose = ["docker-compose", "--env-file", str(env_file), "-f", str(DEPLOY / "compose.yaml"), "--profile", "cpu"]
    cenv = {**os.environ, "COMPOSE_DOCKER_CLI_BUILD": "0", "DOCKER_BUILDKIT": "0"}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit or None, "ok": False,
                    "samples_submitted": args.samples}
    step = "start"
    try:
        result["engine"] = {
            "name": "docker",
            "server_version": sh(["docker", "version", "--format", "{{.Server.Version}}"], "daemon").stdout.strip(),
            "compose": sh(["docker-compose", "version", "--short"], "tools").stdout.strip(),
            "started_here": daemon is not None,
        }
        step = "base"
        base = os.environ.get("BASE_IMAGE")
        if not base:
            base = "hsstream-base:bookworm"
            t = time.monotonic()
            said = sh([str(DEPLOY / "make-base-image.sh"), base], step, timeout=900).stdout.strip()
            print(said, flush=True)
            result["base_image_made"] = "already present" not in said
            result["base_image_s"] = round(time.monotonic() - t, 1)
        result["base_image"] = base
        step = "inputs"
        result["build_inputs"] = fill_build_inputs()
        checkpoints, config = work / "checkpoints", work / "config"
        checkpoints.mkdir()
        config.mkdir()
        write_env(env_file, token, base, port, vllm_port, checkpoints=checkpoints, config=config,
                  train_args=f"--nproc {args.nproc}")  # fmt: skip

        step = "build"
        print("[build] docker-compose --profile cpu build (classic builder, as Compose v1 runs it)", flush=True)
        t = time.monotonic()
        sh([*compose, "build", *([] if args.cache else ["--no-cache"]), "vllm-cpu"], step, timeout=3600, env=cenv)
        result["build_cached"] = args.cache
        result["build_s"] = round(time.monotonic() - t, 1)
        image = f"hsstream-cpu:smoke"
        result["image"] = image
        result["image_bytes"] = int(sh(["docker", "image", "inspect", image, "--format", "{{.Size}}"], step).stdout)
        print(f"[build] {result['build_s']} s, {result['image_bytes'] / 2**30:.2f} GiB", flush=True)

        step = "up"
        t = time.monotonic()
        sh([*compose, "up", "-d", "sidecar-cpu"], step, timeout=2400, env=cenv)  # waits for vllm-cpu healthy
        api = f"http://127.0.0.1:{port}"
        rest = SidecarClient(api, token=token)
        deadline = time.monotonic() + 180
        while True:
            try:
                if rest.readyz().ready:
                    break
            except SidecarError:
                pass
            if time.monotonic() > deadline:
                raise StepFailed(step, "the sidecar's /readyz did not answer 200 within 180 s")
            time.sleep(1)
        result["up_s"] = round(time.monotonic() - t, 1)
        # What the engine says about its thread binding under the container's seccomp profile.
        vlog = sh([*compose, "logs", "--no-color", "vllm-cpu"], step, env=cenv).stdout.splitlines()
        result["numa_binding_lines"] = [ln.split("|", 1)[-1].strip() for ln in vlog
                                        if "hsstream: NUMA binding" in ln or "numa_" in ln and "failed" in ln]
        result["threads_bound"] = [ln.split("]", 1)[-1].strip() for ln in vlog if "core ids=" in ln]
        print(f"[up] vllm-cpu healthy, sidecar ready in {result['up_s']} s", flush=True)

        step = "job"
        from hsstream.demo import demo_prompts

        try:
            job = rest.create_job(demo_prompts(args.samples, seed=1)).job_id
        except SidecarError as e:
            raise StepFailed(step, f"POST /v1/jobs answered {str(e)[:300]}") from e
        try:
            SidecarClient(api, token="").job(job)  # no token
            raise StepFailed(step, "GET /v1/jobs/{id} without the token was not refused")
        except SidecarError as e:
            if e.status != 401:
                raise StepFailed(step, f"GET /v1/jobs/{{id}} without the token answered {e}, not 401") from e

        step = "train"
        import yaml

        (config / "run.yaml").write_text(yaml.safe_dump(run_file(job)))  # TRAIN_CONFIG (write_env)
        t = time.monotonic()
        out = sh([*compose, "run", "--rm", "--no-deps", "trainer-cpu"], step, timeout=1800, env=cenv).stdout
        result["train_s"] = round(time.monotonic() - t, 1)
        result["trainer_exit"] = 0  # sh() raised otherwise
        result["train_config"] = {"TRAIN_CONFIG": "run.yaml", "run_file": run_file(job),
                                  "TRAIN_ARGS": f"--nproc {args.nproc}"}  # fmt: skip
        got, bad = train_verdict(rest.job(job), args.samples, checkpoints / "smoke", last_json(out), args.nproc)
        result.update(got)
        if bad:
            raise StepFailed(step, "; ".join(bad))
        print(f"[train] {result['samples_consumed']} samples consumed by {result['world_size']} ranks, "
              f"{result['train_steps']} steps, checkpoints {result['checkpoints']} in {checkpoints / 'smoke'} "
              f"in {result['train_s']} s", flush=True)

        step = "stop"
        # everything but the spool's own files (its marker, the sidecar's instance lock, the arena):
        # the lock counted as a file left once the sidecar held one, and failed this step
        keep = " ".join(f"! -name {n}" for n in KEPT_NAMES)
        ls = sh([*compose, "exec", "-T", "sidecar-cpu", "sh", "-c", f"find /spool -mindepth 1 {keep} | wc -l"],
                step, timeout=60, env=cenv).stdout.split()
        result["spool_files_after"] = int(ls[-1])
        sh([*compose, "stop", "-t", "60"], step, timeout=300, env=cenv)
        codes = {}
        for cid in sh(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"], step).stdout.split():
            name, code = sh(["docker", "inspect", cid, "--format", "{{.Name}} {{.State.ExitCode}}"], step).stdout.split()
            codes[name.lstrip("/")] = int(code)
        result["exit_codes"] = codes
        sh([*compose, "down", "-v", "--remove-orphans"], step, timeout=300, env=cenv)
        left = sh(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"], step).stdout.split()
        vols = sh(["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"], step).stdout.split()
        result["containers_left"], result["volumes_left"] = len(left), len(vols)
        result["clean_stop"], bad = stop_verdict(codes, result["spool_files_after"], len(left), len(vols))
        result["ok"] = not bad
        if bad:
            raise StepFailed(step, "; ".join(bad))
        return 0
    except StepFailed as e:
        result["failed_step"] = e.step
        print(str(e), file=sys.stderr)
        for svc in CPU_SERVICES:
            p = subprocess.run([*compose, "logs", "--no-color", "--tail", "40", svc], capture_output=True, text=True, env=cenv)
            if p.stdout.strip():
                print(f"--- {svc} (last 40 lines)\n{p.stdout}", file=sys.stderr)
        return 1
    finally:
        if env_file.exists():
            subprocess.run([*compose, "down", "-v", "--remove-orphans"], capture_output=True, env=cenv)
            if not args.keep_images:
                subprocess.run(["docker", "image", "rm", "-f", "hsstream-cpu:smoke"], capture_output=True)
        stop_daemon(daemon)
        result["daemon_stopped"] = daemon is not None
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: result.get(k) for k in ("ok", "engine", "base_image", "build_s", "image_bytes", "up_s",
                                                      "samples_consumed", "train_steps", "clean_stop",
                                                      "spool_files_after", "failed_step")}, indent=2))
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
