"""The reproduction study of docs/REPRODUCTION.md: run.py trains one configuration and arm,
analyze.py turns run directories into the tables and plots of the document."""
