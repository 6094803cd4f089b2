"""``hsstream proxy ...``: run the serving proxy, swap or roll back its draft, see its state,
delete what it teed. Heavy imports happen inside each command (``hsstream --help`` stays fast)."""

from __future__ import annotations

import json
import sys

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Serving proxy: tee live traffic, swap the draft live.\n\nClients point at it "
                       "instead of vLLM; it tees their traffic for training and swaps the draft without a "
                       "restart.")  # fmt: skip


def _settings(**over: object):  # noqa: ANN202
    from hsstream.proxy.settings import ProxySettings

    return ProxySettings(**{k: v for k, v in over.items() if v is not None})


def _admin(url: str | None, method: str, path: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    """One admin call: the proxy's URL and admin token from its settings (state dir)."""
    import httpx

    s = _settings()
    base = (url or f"http://{s.host}:{s.port}").rstrip("/")
    tok = s.resolved_admin_token()
    if not tok:
        typer.echo(f"error: no admin token: set HSSTREAM_PROXY_ADMIN_TOKEN or run where {s.admin_token_file()} is",
                   err=True)  # fmt: skip
        raise typer.Exit(2)
    try:
        r = httpx.request(method, base + path, json=body, timeout=timeout, headers={"authorization": f"Bearer {tok}"})
    except httpx.HTTPError as e:
        typer.echo(f"error: the proxy at {base} did not answer: {e}", err=True)
        raise typer.Exit(3) from e
    if r.status_code != 200:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text[:500]
        typer.echo(f"error: {r.status_code}: {msg}", err=True)
        raise typer.Exit(1)
    return r.json()


@app.command()
def serve(
    upstream: str = typer.Option(None, help="the serving vLLM's URL (default HSSTREAM_PROXY_UPSTREAM); "
                                            "not with --model"),
    host: str = typer.Option(None, help="address to bind (default HSSTREAM_PROXY_HOST, 127.0.0.1)"),
    port: int = typer.Option(None, help="port (default HSSTREAM_PROXY_PORT, 8200)"),
    model: str = typer.Option(None, help="managed mode: start the serving vLLM for this verifier here (swaps then "
                                         "start a new engine: blue/green)"),
    draft: str = typer.Option(None, help="managed mode: the draft it serves first (a speculators-format dir)"),
    version: str = typer.Option("initial", help="the first draft's version, as /metrics and top show it"),
    in_place: bool = typer.Option(False, "--in-place", help="managed mode: swap drafts in place (vLLM's "
                                  "weight-transfer API, our file backend) instead of blue/green"),
    num_speculative_tokens: int = typer.Option(None, min=1, help="managed mode: draft tokens a step"),
    max_model_len: int = typer.Option(1024, help="managed mode: vLLM's context length"),
    tee: bool = typer.Option(None, "--tee/--no-tee", help="tee finished requests to the sidecar (default "
                             "HSSTREAM_PROXY_TEE, on)"),
    log_dir: str = typer.Option(None, help="managed mode: the engines' logs (default STATE_DIR/engines)"),
) -> None:
    """Run the proxy in front of a serving vLLM (or of engines it starts: --model)."""
    import logging
    from pathlib import Path

    from hsstream import launch
    from hsstream.proxy.serve import build_app, run

    if model and upstream:
        raise typer.BadParameter("give --upstream (an engine you run) or --model (engines the proxy runs), not both")
    if (draft or in_place) and not model:
        raise typer.BadParameter("--draft and --in-place are managed mode's: add --model")
    s = _settings(host=host, port=port, upstream=upstream, tee=tee)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    engines, child = None, None
    launch.exit_0_on_stop()  # before the engine starts: a stop while it loads stops it too (EngineManager.start)
    if model:
        from hsstream.proxy.engines import EngineManager

        if draft:
            from hsstream.evaluate import DraftError, check_draft_dir

            try:
                check_draft_dir(draft)
            except DraftError as e:
                typer.echo(f"error: {e}", err=True)
                raise typer.Exit(2) from e
        from hsstream import weight_swap

        engines = EngineManager(model=model, log_dir=Path(log_dir) if log_dir else s.state_dir / "engines",
                                max_model_len=max_model_len, num_speculative_tokens=num_speculative_tokens,
                                served_model_name=None, weight_transfer=weight_swap.WEIGHT_TRANSFER_CONFIG if in_place else None)  # fmt: skip
        typer.echo(f"starting the serving vLLM ({model}, draft {draft or 'none'}) ...", err=True)
        try:
            url, child = engines.start(draft, version)
        except (launch.ProcessDied, TimeoutError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from e
        s = s.model_copy(update={"upstream": url})
    app_ = build_app(s, version=version, draft=draft, engines=engines)
    if child is not None:
        app_.upstreams.live.handle = child
    typer.echo(f"proxy on http://{s.host}:{s.port} -> {s.upstream} (draft {version}); admin token in "
               f"{s.admin_token_file() if not s.admin_token else 'HSSTREAM_PROXY_ADMIN_TOKEN'}", err=True)  # fmt: skip
    try:
        run(app_, s)
    finally:
        if child is not None and child.alive():  # a start-up failure before the app's shutdown ran
            child.stop()


@app.command()
def status(url: str = typer.Option(None, help="the proxy's URL (default http://HSSTREAM_PROXY_HOST:PORT)")) -> None:
    """The live draft, engines draining, the tee's counts, what is stored."""
    typer.echo(json.dumps(_admin(url, "GET", "/admin/state"), indent=1))


def swap_once(draft: str, version: str, *, gate: bool, url: str | None, model: str | None = None,
              max_prompts: int = 32, max_tokens: int = 64, margin: float = 0.0, mode: str | None = None) -> dict:
    """Gate (unless ``gate`` is False) and swap; the admin's record, or ``{"result": "refused_by_gate"}``."""
    from hsstream.proxy import gate as G

    figures = None
    if gate:
        state = _admin(url, "GET", "/admin/state")
        held = _admin(url, "GET", f"/admin/heldout?limit={max_prompts}")["samples"]
        figures = G.measure(draft, state["live"]["draft"], held, model=model, max_tokens=max_tokens)
        typer.echo(json.dumps(figures), err=True)
        if not G.passes(figures, margin):
            return _admin(url, "POST", "/admin/refused", {"version": version, "gate": figures})
    body = {"draft": draft, "version": version, "gate": figures, **({"mode": mode} if mode else {})}
    return _admin(url, "POST", "/admin/swap", body, timeout=3600)


@app.command()
def swap(
    draft: str = typer.Option(..., help="the new draft (a speculators-format dir, e.g. a run's OUT/final)"),
    version: str = typer.Option(None, help="its version (default: the run's name and its checkpoint step)"),
    mode: str = typer.Option(None, help="in_place or blue_green (default: the proxy's)"),
    gate: bool = typer.Option(True, "--gate/--no-gate", help="swap only if the new draft's acceptance on the "
                              "held-out slice of recent traffic is at least the live one's"),
    model: str = typer.Option(None, help="with --gate: the verifier (default: the draft's config's, else HSSTREAM_MODEL)"),
    max_prompts: int = typer.Option(32, min=1, help="with --gate: held-out requests measured"),
    max_tokens: int = typer.Option(64, min=1, help="with --gate: tokens generated per prompt"),
    margin: float = typer.Option(0.0, help="with --gate: the new draft must beat the live one by this much "
                                 "(mean acceptance length)"),
    url: str = typer.Option(None, help="the proxy's URL"),
) -> None:
    """Swap the draft the proxy's engine serves (gated on recent held-out traffic)."""
    from hsstream.evaluate import DraftError, check_draft_dir
    from hsstream.proxy import gate as G

    try:
        check_draft_dir(draft)
    except DraftError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    try:
        rec = swap_once(draft, version or G.draft_version(draft), gate=gate, url=url, model=model,
                        max_prompts=max_prompts, max_tokens=max_tokens, margin=margin, mode=mode)  # fmt: skip
    except (ValueError, RuntimeError) as e:
        typer.echo(f"error: the gate could not measure: {e}", err=True)
        raise typer.Exit(1) from e
    typer.echo(json.dumps(rec, indent=1))
    if rec.get("result") == "refused_by_gate":
        typer.echo("not swapped: the new draft's held-out acceptance is below the live one's", err=True)
        raise typer.Exit(4)


@app.command()
def autoswap(
    run: str = typer.Option(..., help="the run dir `hsstream train --follow --out RUN` writes checkpoints to"),
    every_s: float = typer.Option(300.0, min=1.0, help="seconds between looks at the run's newest checkpoint"),
    gate: bool = typer.Option(True, "--gate/--no-gate", help="as `swap`"),
    model: str = typer.Option(None, help="with --gate: the verifier"),
    max_prompts: int = typer.Option(32, min=1, help="with --gate: held-out requests measured"),
    max_tokens: int = typer.Option(64, min=1, help="with --gate: tokens generated per prompt"),
    margin: float = typer.Option(0.0, help="with --gate: as `swap`"),
    keep: int = typer.Option(2, min=1, help="drafts swapped in kept in RUN/swap-candidates (the live one and "
                             "the one a rollback goes back to)"),
    url: str = typer.Option(None, help="the proxy's URL"),
) -> None:
    """Swap each new checkpoint of a training run in, gated, every --every-s seconds (each gated and
    swapped from a copy in RUN/swap-candidates: the trainer prunes its checkpoints meanwhile)."""
    import time
    from pathlib import Path

    from hsstream import launch
    from hsstream.proxy import gate as G
    from hsstream.proxy.candidates import Candidates

    launch.exit_0_on_stop()
    cands = Candidates(run, keep=keep)  # gated and swapped from copies: the trainer prunes its checkpoints
    tried: set[str] = set()
    while True:
        ckpt = latest_draft(Path(run))
        if ckpt is not None and str(ckpt) not in tried:
            tried.add(str(ckpt))
            version = G.draft_version(ckpt)
            copy, rec = None, {}
            try:
                copy = cands.take(ckpt, version)
                rec = swap_once(str(copy), version, gate=gate, url=url, model=model, max_prompts=max_prompts,
                                max_tokens=max_tokens, margin=margin)  # fmt: skip
                typer.echo(json.dumps({k: rec.get(k) for k in ("t", "from", "to", "result", "seconds", "gate")}))
            except typer.Exit:
                pass  # the proxy said why on stderr; the next look tries the next checkpoint
            except (ValueError, RuntimeError, OSError) as e:
                typer.echo(f"autoswap: {version}: {e}", err=True)
            finally:
                if copy is not None:
                    (cands.swapped_in if rec.get("result") == "done" else cands.drop)(copy)
        time.sleep(every_s)


def latest_draft(run: object):  # noqa: ANN201
    """The newest checkpoint's draft dir of a run (``checkpoints/step-N/draft``), or None."""
    from trainer_client.train.checkpoints import latest_draft as newest

    return newest(run)


@app.command()
def rollback(url: str = typer.Option(None, help="the proxy's URL")) -> None:
    """Go back to the draft version live before the current one."""
    typer.echo(json.dumps(_admin(url, "POST", "/admin/rollback", timeout=3600), indent=1))


@app.command()
def forget(
    older_than: float = typer.Option(None, min=0.0, help="only what was teed more than this many seconds ago"),
    all_: bool = typer.Option(False, "--all", help="everything the proxy teed"),
    url: str = typer.Option(None, help="the proxy's URL"),
) -> None:
    """Delete what was teed: the proxy's store and the sidecar's traffic jobs (purged)."""
    import time

    if all_ == (older_than is not None):
        raise typer.BadParameter("give --all or --older-than SECONDS")
    before = None if all_ else time.time() - float(older_than)
    out = _admin(url, "POST", "/admin/forget", {"before": before}, timeout=600)
    typer.echo(json.dumps(out, indent=1))
    if out.get("failed_jobs"):
        typer.echo(f"error: {len(out['failed_jobs'])} traffic job(s) could not be purged (the sidecar did not answer); "
                   "run it again", err=True)  # fmt: skip
        sys.exit(1)
