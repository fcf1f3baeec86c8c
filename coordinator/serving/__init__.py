"""The request path, top to bottom: a Request (request.py) reaches the Origin (origin.py), which runs it as a
Generation or an Embedding (generation.py): a loop of Attempts (attempt.py), each a session in the SessionTable
(sessions.py) on a route the Router picks (router.py), ending with an Outcome (outcomes.py). The last stages
deliver tokens through the Origin gRPC service (servicer.py); a moving session's KV moves with kv_moves.py. It
imports the control plane (control/), never the reverse."""
