"""The states things of the mesh are in, as StrEnums: each member is its string, so that the registry stores, the
wire carries and the APIs show the same values as before, and a comparison with a misspelt state fails at import
(an AttributeError), not silently at run time."""

from __future__ import annotations

from enum import StrEnum


class AgentState(StrEnum):
    """An agent as the registry knows it."""

    ONLINE = "online"               # registered, its control stream not yet adopted
    CONNECTED = "connected"
    DISCONNECTED = "disconnected"   # its stream ended; its lease has not run out yet
    RESTING = "resting"             # its owner's limits rest it (agent/owner_limits.py)
    DRAINED = "drained"
    DEAD = "dead"                   # its lease ran out, or it kept failing


class PlanState(StrEnum):
    """A model replica's plan: serving (active), loading beside it to take over (standby), or retired."""

    ACTIVE = "active"
    STANDBY = "standby"
    SUPERSEDED = "superseded"       # an active plan a newer one replaced
    ABANDONED = "abandoned"         # a standby that never took over


class StageState(StrEnum):
    """A stage on its agent: what the agent reports of an assignment."""

    ASSIGNED = "assigned"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    RELEASED = "released"


class RequestState(StrEnum):
    """A request the origin runs (its record in the admin API)."""

    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


class ModelState(StrEnum):
    """A deployed model, as /health and the admin API say it is."""

    READY = "ready"                 # a replica's every stage is loaded on a connected agent
    RECOVERING = "recovering"       # it was ready and lost an agent: requests wait for its new route
    STARTING = "starting"           # (/health) not ready yet, and never was
    LOADING = "loading"             # (admin) planned, its stages loading
    WAITING = "waiting"             # (admin) no plan yet: too few agents can hold it
    SCALED_TO_ZERO = "scaled_to_zero"   # autoscaled to no replica: its next request starts one (a cold start)


class RolloutState(StrEnum):
    """A model's new revision on its way in (coordinator/rollouts.py)."""

    CANARY = "canary"               # its replica takes a share of the requests, stepping up while it does well
    PROMOTED = "promoted"           # it reached every request: the model's revision now
    ROLLED_BACK = "rolled_back"     # it did worse than the serving revision (or did not load): given back


class DrainState(StrEnum):
    """A drain of an agent (coordinator/control/drainer.py)."""

    MOVING_STAGES = "moving_stages"
    MOVING_SESSIONS = "moving_sessions"
    DRAINED = "drained"
    FAILED = "failed"


class FinishReason(StrEnum):
    """Why a generation ended, in OpenAI's words."""

    STOP = "stop"           # a stop token or stop string
    LENGTH = "length"       # max_tokens, or the model's context


class RouterMode(StrEnum):
    """How the coordinator's router picks one of a model's ready replicas for a request (control/routes.py)."""

    KV = "kv"                       # the least work ahead of its prompt, counting what prefix caches hold
    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"       # the replica whose busiest stage runs and queues the fewest sequences


class Runtime(StrEnum):
    """What computes a stage's layers on its device; an agent may also let the planner pick (AUTO)."""

    TORCH = "torch"
    ONNXRUNTIME = "onnxruntime"
    AUTO = "auto"                   # an agent's only: the planner picks one of the others per stage


# How the origin's router picks one of a model's ready replicas for a request (coordinator/serving/router.py).
ROUTER_MODES = tuple(RouterMode)
# The formats of tool calls the API parses (coordinator/api/tool_parsers.py), as vLLM's --tool-call-parser names them
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
DEFAULT_ROUTER_MODE = RouterMode.KV
