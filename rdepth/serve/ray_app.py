"""``rdepth serve --replicas N``: N copies of ``rdepth serve`` under Ray Serve, behind one address.

Each replica is a whole server in a process of its own: it loads the checkpoint, builds its engine (continuous
depth batching, per-token exits, a request's own depth) and serves :func:`rdepth.serve.api.build_app`, the same
ASGI app ``rdepth serve`` serves. Ray Serve's proxy listens on ``--host``/``--port`` and hands each HTTP request
to one replica (Ray's router: the less busy of two), so a response is exactly what one ``rdepth serve`` would
have answered, depth report included; the replica that answered is named in the ``x-rdepth-replica`` header.

What one process had and N do not: one engine's batch (each replica batches its own requests), a key/value cache
or a prefix shared between requests on different replicas, and the choice of replica (Ray's).

Without ``--ray-address`` the command starts a Ray cluster of its own on this machine (no dashboard; its files
under ``$RAY_TMPDIR``, else /tmp/ray) and stops it on the way out; with one it joins that cluster and removes
only its own application. Needs the ray extra (``pip install 'rdepth[serve,ray]'``)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading

import ray
from ray import serve

from rdepth.errors import RdepthError
from rdepth.serve.config import ServeConfig
from rdepth.serve.listen import bind_sockets

log = logging.getLogger(__name__)

APP_NAME = "rdepth"
REPLICA_HEADER = b"x-rdepth-replica"


class Replica:
    """One replica: the served model (checkpoint, tokenizer, engine and its thread) built in the replica's own
    process, and ``rdepth serve``'s app in front of it (Ray Serve calls ``__serve_build_asgi_app__`` once this
    constructor returned)."""

    def __init__(self, config: ServeConfig):
        from rdepth.serve.server import served_model

        self.served = served_model(config)
        self.replica = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self):
        from rdepth.serve.api import build_app

        return tagged(build_app(self.served), self.replica)

    def __del__(self):
        served = getattr(self, "served", None)
        if served is not None:
            served.runner.stop()


def tagged(app, replica: str):
    """``app`` with the header ``x-rdepth-replica: REPLICA`` on every HTTP response it starts."""
    value = replica.encode()

    async def with_header(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, value)]}
            await send(message)

        return await app(scope, receive, send_tagged)

    return with_header


def replica_cpus(config: ServeConfig) -> int:
    """The CPUs Ray holds for each replica, and its torch threads: ``--threads``, else one."""
    return config.threads or 1


def check_before_ray(config: ServeConfig) -> None:
    """What ``rdepth serve`` refuses before it loads anything, refused here before Ray starts (a replica that fails
    to load is one line too, but only after Ray and the replicas started): the policies, the checkpoint's folder
    and config, the context, and (on a cluster of its own) the port."""
    from rdepth.run.checkpoint import load_model_config, resolve_checkpoint
    from rdepth.serve.server import check_policies

    check_policies(config)
    checkpoint = resolve_checkpoint(config.checkpoint)
    block_size = load_model_config(checkpoint).block_size
    if config.context is not None and config.context > block_size:
        raise RdepthError(f"serve: --context {config.context} exceeds the model's block size {block_size}")
    if config.ray_address is None:
        for sock in bind_sockets(config.host, config.port):  # in use: one line now (Ray's proxy binds it later)
            sock.close()


def serve_replicas(config: ServeConfig) -> int:
    """Serve ``config.replicas`` copies of the server under Ray Serve until interrupted, then remove them (and the
    Ray cluster, when this call started it)."""
    check_before_ray(config)
    cpus = replica_cpus(config)
    replica_config = dataclasses.replace(config, threads=cpus, replicas=None, ray_address=None, replica_gpus=0.0)
    own_cluster = config.ray_address is None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing sent to Ray's usage statistics unless asked
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    ray.init(address=config.ray_address, num_cpus=config.replicas * cpus if own_cluster else None,
             include_dashboard=False, logging_level=logging.WARNING, log_to_driver=log.isEnabledFor(logging.DEBUG))
    # Ray's core worker aborts the process on SIGTERM: the command's own handling (one line, every ``finally``
    # run, the cluster stopped) comes back.
    for number, handler in handlers.items():
        if callable(handler) and threading.current_thread() is threading.main_thread():
            signal.signal(number, handler)
    if not log.isEnabledFor(logging.DEBUG):  # Serve's own INFO lines (one says, wrongly here, that the port given
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # to serve.start is not applied): with -v only
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        # Ray's router sends a replica at most max_ongoing_requests at once (its default, 5, would leave most of
        # an engine's slots idle): the engine's batch, and as many waiting for a slot to free.
        deployment = serve.deployment(serve.ingress()(Replica), name="Replica").options(
            num_replicas=config.replicas, ray_actor_options={"num_cpus": cpus, "num_gpus": config.replica_gpus},
            max_ongoing_requests=2 * config.batch_size)
        try:
            serve.run(deployment.bind(replica_config), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as exc:  # a replica that failed to start: its error is in the deployment's status
            raise RdepthError(f"serve: the replicas did not start: {replica_failure(exc)}") from None
        log.info("serving %s as %d replicas under Ray Serve on http://%s:%d (%d CPU%s each)", config.checkpoint,
                 config.replicas, config.host, config.port, cpus, "s" if cpus != 1 else "")
        threading.Event().wait()  # until Ctrl-C or SIGTERM
    finally:
        try:
            if own_cluster:
                serve.shutdown()
            else:  # a cluster others may serve on: only this application goes
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
    return 0


def replica_failure(exc: BaseException) -> str:
    """Why the replicas did not start, in one line: the replica's own error (an RdepthError's message, as
    ``rdepth serve`` would have printed it) from the deployment's status, else the last line of Ray's."""
    try:
        application = serve.status().applications.get(APP_NAME)
        texts = [deployment.message for deployment in application.deployments.values()] if application else []
    except Exception:  # the status is a courtesy: Ray's own words below
        texts = []
    for text in [*texts, str(exc)]:
        for line in reversed(text.splitlines()):
            if "RdepthError:" in line:
                return line.split("RdepthError:", 1)[1].strip()
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
