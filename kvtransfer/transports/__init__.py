"""Transport implementations, looked up by name (see `kvtransfer.factory`)."""
