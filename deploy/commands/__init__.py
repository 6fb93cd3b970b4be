"""One module per `postrain` verb (see deploy/cli.py for the contract)."""
