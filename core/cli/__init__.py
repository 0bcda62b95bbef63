"""Command-line interface (`k3`)."""
