"""The embedded sandbox: a whole subnet on one machine."""
