"""RayEngineFactory: engine cores on Ray Serve for the server's model registry. It starts a local Ray
instance bound to 127.0.0.1 (or joins ``--ray-address``), starts Serve without its HTTP proxies (the
pagedserve front end is the HTTP server), and deploys each served model, and each engine that replaces
one, as its own Serve application of ``EngineReplica`` replicas behind the configured request router.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import re

from pagedserve.cluster.ray_client import RayEngineCoreClient
from pagedserve.cluster.replica import EngineReplica
from pagedserve.cluster.routers import ROUTER_CLASSES
from pagedserve.config import ClusterConfig, ModelSpec
from pagedserve.engine.core_client import EngineCapacityError, EngineCoreClient

logger = logging.getLogger("pagedserve.cluster")

REPLICA_ACTOR_PREFIX = "SERVE_REPLICA::"  # Ray Serve names replica actors SERVE_REPLICA::<app>#<deployment>#<id>
SERVE_NAMESPACE = "serve"
DEPLOYMENT_NAME = "engine"
MAX_ONGOING_CALLS = 100_000


LOOPBACK_ENV = ("RAY_USAGE_STATS_ENABLED", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")


def _environment_for_local_ray() -> None:
    """Before ``ray.init`` starts a local instance: no usage stats, and every address kept on loopback.

    NOTE: Ray replaces a ``_node_ip_address`` of 127.0.0.1 with the machine's outward address unless its
    multi-node mode is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read once when Ray is imported). The
    variable reaches the processes ``ray.init`` starts (GCS, raylet, workers); for this process, which may
    have imported Ray already, the flag it was read into is set too.
    """
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


class RayEngineFactory:
    """``create(spec)`` deploys one Serve application per engine and returns its RayEngineCoreClient."""

    def __init__(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster
        self._generation = itertools.count()
        self._started_ray = False
        self._connected = False

    # ----------------------------------------------------------------- EngineFactory
    def create(self, spec: ModelSpec, *, at_startup: bool) -> EngineCoreClient:
        """Deploy ``spec.replicas`` warmed-up replicas (blocking); raises EngineCapacityError when the
        cluster has no room for them, RuntimeError if they cannot start."""
        from ray import serve

        self._connect()
        self._check_room(spec)
        app_name = f"{_app_safe(spec.name)}-{next(self._generation)}"
        deployment = self._deployment(spec)
        logger.info("deploying %d replica(s) of %r as Ray Serve application %r", spec.replicas, spec.name, app_name)
        try:
            replica_args = (self._replica_spec(spec), self.cluster.cpus_per_replica)
            handle = serve.run(deployment.bind(*replica_args), name=app_name, route_prefix=None)
            model_info = handle.model_info.remote().result()
        except BaseException as exc:
            _delete_app(app_name)
            raise RuntimeError(f"the replicas of {spec.name!r} failed to start: {exc}") from exc
        return RayEngineCoreClient(
            handle,
            model_info,
            spec.name,
            list_replica_actors=lambda: _replica_actors(app_name),
            on_shutdown=lambda: _delete_app(app_name),
        )

    def close(self) -> None:
        if not self._connected:
            return
        import ray
        from ray import serve

        try:
            if self._started_ray:
                serve.shutdown()
        finally:
            ray.shutdown()
            self._connected = False

    # ----------------------------------------------------------------- internals
    def _connect(self) -> None:
        if self._connected:
            return
        import ray
        from ray import serve

        cluster = self.cluster
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if cluster.ray_address is None:
            _environment_for_local_ray()
            ray.init(
                address="local",
                _node_ip_address="127.0.0.1",
                include_dashboard=cluster.dashboard,
                dashboard_host="127.0.0.1",
                object_store_memory=cluster.object_store_memory,
                num_cpus=os.cpu_count(),
                logging_level=logging.WARNING,
                # the workers resolve their own address too: the same switch keeps them on 127.0.0.1
                runtime_env={"env_vars": {name: os.environ[name] for name in LOOPBACK_ENV}},
            )
            self._started_ray = True
        else:
            ray.init(address=cluster.ray_address, logging_level=logging.WARNING)
        self._connected = True
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})

    def _check_room(self, spec: ModelSpec) -> None:
        """Refuse a deployment the cluster's free resources cannot place: Serve would wait for them
        forever. While a model is replaced, its old replicas keep their share until the new ones serve.

        NOTE: an autoscaling cluster could add the room later; this checks what is free now."""
        import ray

        free = ray.available_resources()
        short = []
        for kind, per_replica in (("CPU", self.cluster.cpus_per_replica), ("GPU", self.cluster.gpus_per_replica)):
            need = spec.replicas * (per_replica or 0.0)
            if need > free.get(kind, 0.0) + 1e-9:
                short.append(f"{need:g} {kind} (free: {free.get(kind, 0.0):g})")
        if short:
            raise EngineCapacityError(
                f"the cluster has no room for {spec.replicas} replica(s) of {spec.name!r}: they need "
                f"{', '.join(short)}. Engines being replaced keep their share until the new ones serve; "
                "ask for fewer replicas, start with a smaller --cpus-per-replica, or add nodes."
            )

    def _deployment(self, spec: ModelSpec):
        from ray import serve
        from ray.serve.config import RequestRouterConfig

        cluster = self.cluster
        router_kwargs = (
            {"imbalance_threshold": cluster.imbalance_threshold} if cluster.request_router == "prefix-affinity" else {}
        )
        return serve.deployment(
            EngineReplica,
            name=DEPLOYMENT_NAME,
            num_replicas=spec.replicas,
            # calls, not requests: a short `add` each, one long `outputs` stream per front end; the engine
            # queues what it cannot run yet and the front end's admission control bounds that
            max_ongoing_requests=MAX_ONGOING_CALLS,
            ray_actor_options=self._actor_options(),
            request_router_config=RequestRouterConfig(
                request_router_class=ROUTER_CLASSES[cluster.request_router],
                request_router_kwargs=router_kwargs,
                request_routing_stats_period_s=1.0,
                request_routing_stats_timeout_s=10.0,
            ),
            health_check_period_s=2.0,
            health_check_timeout_s=60.0,
            graceful_shutdown_timeout_s=30.0,
            max_constructor_retry_count=1,
            logging_config={"log_level": "WARNING", "enable_access_log": False},
        )

    def _actor_options(self) -> dict:
        cluster = self.cluster
        options: dict = {"num_cpus": cluster.cpus_per_replica, "num_gpus": cluster.gpus_per_replica}
        if self._started_ray:  # the Serve controller starts replicas without the driver's runtime env
            options["runtime_env"] = {"env_vars": {name: os.environ[name] for name in LOOPBACK_ENV}}
        return options

    def _replica_spec(self, spec: ModelSpec) -> ModelSpec:
        """The spec a replica builds: its torch threads sized to its CPU share unless set."""
        config = spec.engine_config
        if config.num_threads is None:
            threads = max(1, math.floor(self.cluster.cpus_per_replica))
            config = dataclasses.replace(config, num_threads=threads)
        return dataclasses.replace(spec, engine_config=config)


def _app_safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _replica_actors(app_name: str) -> dict:
    """Replica id -> Ray actor handle of the application's live replicas (NOTE: Serve's actor names)."""
    import ray

    prefix = f"{REPLICA_ACTOR_PREFIX}{app_name}#{DEPLOYMENT_NAME}#"
    actors = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == SERVE_NAMESPACE and entry["name"].startswith(prefix):
            try:
                actors[entry["name"][len(prefix) :]] = ray.get_actor(entry["name"], namespace=SERVE_NAMESPACE)
            except ValueError:
                continue  # gone since it was listed
    return actors


def _delete_app(app_name: str) -> None:
    from ray import serve

    try:
        serve.delete(app_name)
    except Exception:  # noqa: BLE001 - shutting down; nothing left to serve
        logger.warning("could not delete Ray Serve application %r", app_name, exc_info=True)
