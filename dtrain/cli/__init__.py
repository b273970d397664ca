"""The ``dtrain`` command line: one module per subcommand, all thin shells over the core."""
