"""``python -m dtrain`` runs the same Typer app as the ``dtrain`` script."""

from dtrain.cli.app import main

if __name__ == "__main__":
    main()
