"""Arguments shared by verbs: --config FILE and --set KEY=VALUE overrides."""


def add_config_args(p, default: str | None = None) -> None:
    p.add_argument("--config", default=default, help=f"TOML/YAML config file (default: {default or 'built-in defaults'})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set sft.steps=200 (repeatable)")


def default_config(name: str) -> str | None:
    """configs/NAME.toml of the repository, when present."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}.toml"
    return str(path) if path.is_file() else None


def add_cluster_args(p) -> None:
    """--cluster FILE, --ray-address, --dry-run (deploy/cluster.py)."""
    p.add_argument("--cluster", metavar="FILE", help="cluster file (configs/cluster.toml): Ray address, resources, "
                   "services, shared storage (default: $POSTRAIN_CLUSTER)")
    p.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to join (GCS host:port); default: [ray] address, "
                   "else $RAY_ADDRESS, else a local Ray")
    p.add_argument("--dry-run", action="store_true", help="check that Ray, PostgreSQL, the WAL and sandbox services "
                   "and the storage are reachable, report each, and exit")
