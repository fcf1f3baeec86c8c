"""The one exception family of stratamesh; every part raises these, never bare Exception."""

from __future__ import annotations


# A daemon's exit status when the mesh will not have it (a revoked certificate, no usable join token): a supervisor
# does not start it again, since that cannot help.
EXIT_REFUSED = 3


class MeshError(Exception):
    """Base of every stratamesh error."""


class Refused(MeshError):
    """The mesh will not have this process; its daemon exits with EXIT_REFUSED."""


class InvalidInput(MeshError):
    """A request, message or file failed validation; the message names the field."""


class InvalidAssignment(InvalidInput):
    """An assignment failed validation; assignment_id says which, so its agent can report that stage failed."""

    def __init__(self, assignment_id: str, reason: str):
        super().__init__(reason)
        self.assignment_id = assignment_id


class ModelNotFound(MeshError):
    """No model of that name is deployed on the mesh."""


class ModelNotReady(MeshError):
    """The model is deployed but not every stage of its plan is ready yet."""


class ContextLengthExceeded(InvalidInput):
    """Prompt plus requested tokens do not fit the model's context."""


class CheckpointError(MeshError):
    """A model folder is missing files or holds tensors that do not match its config."""


class StageFailed(MeshError):
    """A pipeline stage failed a session or could not be reached."""


class PlacementError(MeshError):
    """The fleet cannot hold the model under the given constraints."""
