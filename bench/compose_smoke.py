"""``make compose-smoke``: build the compose stack's cpu profile and run it for real.

Steps, each named in the failure line when it fails (with the failing container's log tail):

1. tools     docker.io and docker-compose from Debian if missing (root), mmdebstrap for the base;
2. daemon    a running engine, or ``dockerd`` started here (and stopped at the end, by its pid);
3. base      ``$BASE_IMAGE`` if set, else ``deploy/make-base-image.sh`` (Debian packages only);
4. inputs    deploy/build-inputs/: pip's CA bundle and torch's CPU wheel from pip's find-links;
5. build     ``docker-compose --profile cpu build`` (timed; the image's size read after);
6. up        vllm-cpu and the sidecar, ``depends_on: service_healthy`` as compose.yaml says;
7. job       a job submitted from the host over REST (the published port, the generated token);
8. train     the trainer service (``run --no-deps``) follows that job until it is consumed and a
             checkpoint is written; its steps read from its metrics.jsonl;
9. stop      the stack stopped (clean stop = every container exited 0 or by SIGTERM), the spool
             volume's files counted before ``down -v``, then no container of the project left.

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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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


def write_env(path: Path, token: str, base_image: str, port: int, vllm_port: int) -> None:
    """deploy/.env.example with what the cpu profile needs: a real token, small spool, free ports."""
    over = {
        "COMPOSE_PROFILES": "cpu", "COMPOSE_PROJECT_NAME": PROJECT, "HSSTREAM_IMAGE_TAG": "smoke",
        "HSSTREAM_API_TOKEN": token, "BASE_IMAGE": base_image, "SPOOL_SIZE": "1g",
        "HSSTREAM_SPOOL_BUDGET_BYTES": str(256 << 20), "HSSTREAM_PORT": str(port), "VLLM_PORT": str(vllm_port),
        "MODEL_DIR": str(DEPLOY),  # unused by the cpu services (the model is in the image); must be a path
    }
    lines = []
    for line in (DEPLOY / ".env.example").read_text().splitlines():
        key = line.split("=", 1)[0]
        if "=" in line and not line.startswith("#") and key in over:
            line = f"{key}={over.pop(key)}"
        lines.append(line)
    lines += [f"{k}={v}" for k, v in over.items()]
    path.write_text("\n".join(lines) + "\n")


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
        write_env(env_file, token, base, port, vllm_port)

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
        sh([*compose, "up", "-d", "sidecar-cpu"], step, timeout=900, env=cenv)  # waits for vllm-cpu healthy
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
        t = time.monotonic()
        sh([*compose, "run", "--rm", "--no-deps", "trainer-cpu", "--out", "/checkpoints/smoke", "--job", job,
            "--api", "http://sidecar:8100", "--checkpoint-every", "8", "--warmup", "4", "--no-progress"],
           step, timeout=1800, env=cenv)
        result["train_s"] = round(time.monotonic() - t, 1)
        result["trainer_exit"] = 0  # sh() raised otherwise
        st = rest.job(job)
        result["job_counts"] = st.counts
        result["samples_consumed"] = int(st.counts.get("consumed", 0))
        metrics = sh([*compose, "run", "--rm", "--no-deps", "--entrypoint", "sh", "trainer-cpu", "-c",
                      "cat /checkpoints/smoke/metrics.jsonl; echo ---; ls /checkpoints/smoke/checkpoints"],
                     step, timeout=120, env=cenv).stdout
        lines, _, ckpts = metrics.partition("---")
        steps = [json.loads(x).get("step", 0) for x in lines.splitlines() if x.strip().startswith("{")]
        result["train_steps"] = max(steps) if steps else 0
        result["checkpoints"] = ckpts.split()
        # docs/deploy.md's way to copy the draft out, which Compose v1 (no `cp`) runs too.
        out_dir = work / "out"
        out_dir.mkdir()
        sh([*compose, "run", "--rm", "--no-deps", "-v", f"{out_dir}:/out", "--entrypoint", "cp", "trainer-cpu",
            "-r", "/checkpoints", "/out"], step, timeout=120, env=cenv)
        result["copied_out"] = sorted(p.name for p in (out_dir / "checkpoints" / "smoke" / "checkpoints").glob("step-*"))
        if not st["done"] or result["samples_consumed"] != args.samples or not result["checkpoints"] \
                or result["copied_out"] != result["checkpoints"]:
            raise StepFailed(step, f"job {job}: done={st['done']}, counts {st['counts']}, checkpoints {ckpts.split()}")
        print(f"[train] {result['samples_consumed']} samples consumed, {result['train_steps']} steps, "
              f"checkpoints {result['checkpoints']} in {result['train_s']} s", flush=True)

        step = "stop"
        ls = sh([*compose, "exec", "-T", "sidecar-cpu", "sh", "-c", "find /spool -mindepth 1 ! -name .hsstream-spool | wc -l"],
                step, timeout=60, env=cenv).stdout.split()
        result["spool_files_after"] = int(ls[-1])
        sh([*compose, "stop", "-t", "60"], step, timeout=300, env=cenv)
        codes = {}
        for cid in sh(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"], step).stdout.split():
            name, code = sh(["docker", "inspect", cid, "--format", "{{.Name}} {{.State.ExitCode}}"], step).stdout.split()
            codes[name.lstrip("/")] = int(code)
        result["exit_codes"] = codes
        result["clean_stop"] = bool(codes) and all(c in (0, 143) for c in codes.values())
        sh([*compose, "down", "-v", "--remove-orphans"], step, timeout=300, env=cenv)
        left = sh(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"], step).stdout.split()
        vols = sh(["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"], step).stdout.split()
        result["containers_left"], result["volumes_left"] = len(left), len(vols)
        result["ok"] = (result["clean_stop"] and result["spool_files_after"] == 0 and not left and not vols)
        if not result["ok"]:
            raise StepFailed(step, f"exit codes {codes}, spool files {result['spool_files_after']}, "
                                   f"containers left {len(left)}, volumes left {len(vols)}")
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
