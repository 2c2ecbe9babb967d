"""Python client for the ampwatch REST API, and the `ampwatch` command line."""
