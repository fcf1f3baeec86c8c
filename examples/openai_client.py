"""The official `openai` client against a stratamesh mesh: list models, complete, stream a chat, catch an error.

    .venv/bin/python examples/openai_client.py                              # starts a small mesh here
    .venv/bin/python examples/openai_client.py --url http://127.0.0.1:8000  # or uses one from `stratamesh up`

With --url, the client sends the API key of --api-key, else of $STRATAMESH_API_KEY (`stratamesh up` prints one).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

import openai
from openai import OpenAI

from stratamesh import Mesh


@contextlib.contextmanager
def local_mesh(num_agents: int) -> Iterator[tuple[str, str]]:
    """A coordinator and num_agents agents on loopback serving the built-in demo model; yields its URL and key."""
    print(f"starting a coordinator and {num_agents} agents (each imports torch: a few seconds) ...", flush=True)
    with Mesh.local(agents=num_agents) as mesh:   # the SDK starts (and at the end stops) the processes
        yield mesh.url, mesh.local_mesh.api_key   # an operator API key the launcher made


def demo(client: OpenAI, max_tokens: int) -> None:
    """Runs every call once against client and prints what came back."""
    models = client.models.list().data
    print("models:", ", ".join(m.id for m in models))
    model = models[0].id

    # The built-in model has random weights: its text is gibberish, but it travelled through every stage.
    completion = client.completions.create(model=model, prompt="I went to", max_tokens=max_tokens, temperature=0)
    print(f"completion: {completion.choices[0].text!r} ({completion.usage.completion_tokens} tokens, "
          f"finish_reason={completion.choices[0].finish_reason})")

    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello from the edge"}],
        max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
    print("chat stream: ", end="", flush=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:   # the last chunk carries the usage (stream_options.include_usage)
            print(f"\n  ({chunk.usage.completion_tokens} tokens)")

    # Errors come back in OpenAI's shape, so the client raises its usual exceptions.
    try:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    except openai.NotFoundError as exc:
        print(f"unknown model -> {type(exc).__name__} ({exc.status_code}): {exc.body['message']}")
    else:
        raise SystemExit("an unknown model should have raised openai.NotFoundError")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running mesh, e.g. http://127.0.0.1:8000/v1; default: start one here")
    parser.add_argument("--api-key", default=os.environ.get("STRATAMESH_API_KEY", ""),
                        help="the running mesh's API key (default: $STRATAMESH_API_KEY)")
    parser.add_argument("--agents", type=int, default=2, help="agents of the mesh started here")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url, api_key = (args.url, args.api_key) if args.url else stack.enter_context(local_mesh(args.agents))
        # OpenAI clients take the API root with /v1 and send api_key as the bearer token the mesh asks for
        # (a mesh started with --insecure asks for none, but the client insists on one).
        client = OpenAI(base_url=url.rstrip("/").removesuffix("/v1") + "/v1", api_key=api_key or "unused")
        try:
            demo(client, args.max_tokens)
        except openai.APIConnectionError:
            raise SystemExit(f"no mesh answers at {url}") from None
    print("done")


if __name__ == "__main__":
    main()
