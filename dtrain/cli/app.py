def main() -> None:  # placeholder until the Typer app lands
    raise SystemExit("dtrain CLI is being built")
