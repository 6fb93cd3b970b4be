"""`postrain domains`: list the task domains."""
NAME = "domains"
HELP = "list the verifiable task domains"


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print a JSON list")


def run(args) -> int:
    import json

    import rewards

    rows = [{"name": n, "description": rewards.domain(n).description, "uses_tools": rewards.domain(n).uses_tools}
            for n in rewards.domains()]
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"{r['name']:10s} {r['description']}")
    return 0
