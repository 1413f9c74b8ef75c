"""What the tests share: factories for the data model, helpers that start processes, clusters and
browsers, plugins and environments named by import path in test configs, and the zygote that forks
the processes the tests start."""
