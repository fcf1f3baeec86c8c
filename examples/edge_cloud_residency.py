"""An edge + cloud split with data residency: the first and last stage stay on the edge site.

    .venv/bin/python examples/edge_cloud_residency.py
    .venv/bin/python examples/edge_cloud_residency.py --cloud-ranks 2   # a cloud stage may be a TP=2 group

Some agents are edge boxes at the site "factory", the others cloud nodes at the site "cloud-eu". The
coordinator pins the first stage (it embeds the token ids) and the last stage (it samples the next token
ids) to the factory, so token ids never leave it: the cloud nodes only see hidden states, the middle
layers' activations. Here every "box" is a process on this machine; on real boxes run the same flags:

    stratamesh coordinator --model DIR --stages 3 --first-site factory --last-site factory
    stratamesh agent --site factory --tier edge       # on each edge box
    stratamesh agent --site cloud-eu --tier cloud     # on each cloud node
"""

from __future__ import annotations

import argparse
import textwrap
import time

import httpx

from stratamesh import Mesh

EDGE_SITE = "factory"
CLOUD_SITE = "cloud-eu"


def agent_flags(num_edge: int, num_cloud: int, cloud_ranks: int) -> dict[int, list[str]]:
    """Each agent's --site and --tier: the first num_edge at the edge site, the rest in the cloud."""
    flags = {i: ["--site", EDGE_SITE, "--tier", "edge"] for i in range(num_edge)}
    for i in range(num_edge, num_edge + num_cloud):
        flags[i] = ["--site", CLOUD_SITE, "--tier", "cloud", "--ranks", str(cloud_ranks)]
    return flags


def show_plan(mesh: Mesh, num_agents: int) -> list[str]:
    """Prints the active plan stage by stage with each agent's site; returns the site of each stage."""
    # The model is ready once its stages are: a spare may still be joining. Wait for every agent.
    deadline = time.monotonic() + 30
    while len(agents := {a.agent_id: a for a in mesh.agents()}) < num_agents and time.monotonic() < deadline:
        time.sleep(0.2)
    # The SDK has no call for plans: the admin API has them, for the operator API key the launcher made.
    plans = httpx.get(f"{mesh.url}/admin/api/plans", headers=mesh.local_mesh.headers).json()["plans"]
    (plan,) = [p for p in plans if p["state"] == "active"]
    print(f"plan for {plan['model_id']}:")
    sites = []
    for index, stage in enumerate(sorted(plan["stages"], key=lambda s: s["start_layer"])):
        agent = agents[stage["agent_id"]]
        print(f"  stage {index}: layers [{stage['start_layer']}, {stage['end_layer']}) "
              f"tp_degree={stage['tp_degree']} on {agent.name} (site={agent.site}, tier={agent.tier})")
        sites.append(agent.site)
    planned = {s["agent_id"] for s in plan["stages"]}
    print(f"  spares: {', '.join(sorted(a.name for a in agents.values() if a.agent_id not in planned)) or 'none'}")
    print(textwrap.fill(f"why: {plan['reason']}", width=110, initial_indent="  ", subsequent_indent="    "))
    return sites


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edge-agents", type=int, default=2, help=f"agents at the edge site {EDGE_SITE!r}")
    parser.add_argument("--cloud-agents", type=int, default=2, help=f"agents at the cloud site {CLOUD_SITE!r}")
    parser.add_argument("--cloud-ranks", type=int, default=1,
                        help="ranks a tensor-parallel stage on a cloud agent may have (on a CPU box TP rarely pays)")
    parser.add_argument("--stages", type=int, default=3)
    args = parser.parse_args()

    print(f"starting a coordinator, {args.edge_agents} edge and {args.cloud_agents} cloud agents ...", flush=True)
    local = Mesh.local(
        agents=args.edge_agents + args.cloud_agents, stages=args.stages,
        agent_args_by_index=agent_flags(args.edge_agents, args.cloud_agents, args.cloud_ranks),
        # Data residency: the first and the last stage must run at the edge site.
        coordinator_args=["--first-site", EDGE_SITE, "--last-site", EDGE_SITE])
    with local as mesh:
        sites = show_plan(mesh, args.edge_agents + args.cloud_agents)
        if sites[0] != EDGE_SITE or sites[-1] != EDGE_SITE:
            raise SystemExit(f"residency violated: the first and last stage run at {sites[0]!r} and {sites[-1]!r}")
        print(f"residency holds: token ids enter and leave the pipeline at {EDGE_SITE!r}; "
              f"{CLOUD_SITE!r} sees only hidden states")

        # The origin (it tokenizes the prompt and detokenizes the answer) runs inside the coordinator, so in a
        # real deployment run the coordinator at the edge site too: then the text never leaves the factory.
        completion = mesh.generate("Sensor 7 reads", max_tokens=16)
        # The built-in model has random weights: the text is gibberish.
        print(f"completion: {completion.text!r}")
    print("done")


if __name__ == "__main__":
    main()
