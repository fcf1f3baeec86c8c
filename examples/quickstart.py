"""Quickstart: start a mesh on this machine and use it from Python with the SDK.

    .venv/bin/python examples/quickstart.py
    .venv/bin/python examples/quickstart.py --url http://127.0.0.1:8000   # a mesh already up (`stratamesh up`)

With --url, the SDK sends the API key of --api-key, else of $STRATAMESH_API_KEY (`stratamesh up` prints one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import stratamesh
from stratamesh import AsyncMesh, Mesh


def tour(mesh: Mesh) -> None:
    """What the SDK can do, one call each."""
    for model in mesh.models():
        print(f"model {model.id}: context {model.max_context} tokens, ready={model.ready}")
    for agent in mesh.agents():
        print(f"agent {agent.name} ({agent.agent_id}): {agent.state}, {agent.num_cpus} CPUs, "
              f"{len(agent.gpus)} GPUs, tier={agent.tier}")

    # The built-in model has random weights: it answers gibberish, but every token crossed every stage.
    # With one model served, model= may be left out.
    completion = mesh.generate("I went to", max_tokens=16)
    print(f"generate: {completion.text!r} ({completion.finish_reason})")

    conversation = [{"role": "user", "content": "Where do my layers run?"}]
    answer = mesh.chat(conversation, max_tokens=16)
    print(f"chat: {answer.content!r} ({answer.usage.prompt_tokens} prompt + "
          f"{answer.usage.completion_tokens} completion tokens)")
    conversation += [answer.message, {"role": "user", "content": "And then?"}]   # the next turn
    print(f"chat, turn 2: {mesh.chat(conversation, max_tokens=16).content!r}")

    print("chat stream: ", end="", flush=True)
    for chunk in mesh.chat([{"role": "user", "content": "Stream, please"}], max_tokens=16, stream=True):
        print(chunk.content, end="", flush=True)
    print()

    # Errors are exceptions named like the openai package's; all derive from stratamesh.MeshError.
    try:
        mesh.generate("hi", model="no-such-model")
    except stratamesh.NotFoundError as exc:
        print(f"unknown model -> NotFoundError: {exc.message}")


async def async_tour(url: str, api_key: str | None) -> None:
    """AsyncMesh has the same calls, awaited: here four prompts at once, batched by the stages."""
    async with AsyncMesh(url, api_key=api_key) as mesh:
        prompts = [f"Request {i}:" for i in range(4)]
        completions = await asyncio.gather(*(mesh.generate(p, max_tokens=8) for p in prompts))
        print(f"async: {len(completions)} completions, {sum(c.usage.completion_tokens for c in completions)} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running mesh; default: start one here")
    parser.add_argument("--api-key", help="the running mesh's API key (default: $STRATAMESH_API_KEY)")
    parser.add_argument("--agents", type=int, default=3, help="agents of the mesh started here")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        if args.url:
            mesh = stack.enter_context(Mesh(args.url, api_key=args.api_key))   # None: $STRATAMESH_API_KEY
            api_key = args.api_key
        else:
            # A coordinator and N agents as processes on loopback, serving the built-in demo model split into N
            # pipeline stages; all of them stop when the block ends, also on an exception. The SDK's client
            # sends the operator API key the launcher made; a second client needs it too.
            print(f"starting a coordinator and {args.agents} agents ...", flush=True)
            mesh = stack.enter_context(Mesh.local(agents=args.agents))
            api_key = mesh.local_mesh.api_key
        try:
            tour(mesh)
            asyncio.run(async_tour(mesh.url, api_key))
        except stratamesh.MeshConnectionError as exc:
            raise SystemExit(f"no mesh answers: {exc}") from None
    print("done")


if __name__ == "__main__":
    main()
