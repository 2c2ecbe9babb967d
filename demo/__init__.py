"""`ampwatch demo`: a server (started as a child process unless one is running), a
webhook receiver, and small models trained on the CPU with the agent attached, one per
failure it shows (docs/client.md). Apart from the agent, which installs into training
processes: nothing in ampwatch.agent imports this package."""
