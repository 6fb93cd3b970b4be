"""`postrain storage`: check a pyarrow.fs URI, publish a checkpoint to one, fetch it back verified."""

NAME = "storage"
HELP = "pyarrow.fs run storage: check a URI, push a checkpoint directory as a committed tree, pull one back verified"


def add_arguments(p):
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("check", help="write, read back and delete a probe object under URI")
    c.add_argument("uri")
    u = sub.add_parser("push", help="upload a local checkpoint directory to URI: every file, then MANIFEST.json "
                       "(sha256 of each) last; `--init URI` / `--checkpoint URI` read it")
    u.add_argument("src", help="local directory (an HF checkpoint)")
    u.add_argument("uri")
    d = sub.add_parser("pull", help="download the committed tree at URI (or URI/final) into DEST, every file checked")
    d.add_argument("uri")
    d.add_argument("dest", help="a new or empty directory")
    d.add_argument("--replace", action="store_true",
                   help="replace DEST when it holds files (what is in it is deleted once the download is verified)")


def run(args) -> int:
    from pathlib import Path

    from core.errors import UserError
    from dataplane.remote import RemoteStore

    store = RemoteStore(args.uri)
    if args.action == "check":
        print(store.probe())
    elif args.action == "push":
        if not Path(args.src).is_dir():
            raise UserError(f"storage push: {args.src} is not a directory")
        m = store.upload_tree(args.src, "")
        print(f"{len(m['files'])} files, {sum(e['bytes'] for e in m['files'].values())} bytes -> {args.uri} (committed)")
    else:
        _check_dest(Path(args.dest), args.replace)
        rel = "" if store.manifest("") is not None else "final"
        m = store.download_tree(rel, args.dest)
        print(f"{len(m['files'])} files from {store.url(rel)} -> {args.dest}, sha256 verified")
    return 0


def _check_dest(dest, replace: bool) -> None:
    """A pull writes into a new or empty directory; one that holds files is replaced only when asked, as the
    download deletes what was there."""
    from core.errors import UserError

    if dest.exists() and not dest.is_dir():
        raise UserError(f"storage pull: {dest} exists and is not a directory")
    if not replace and dest.is_dir() and any(dest.iterdir()):
        raise UserError(f"storage pull: {dest} is not empty; give a new directory, or --replace to delete what it "
                        "holds and put the checkpoint there")
