"""`flywheel doctor`: a run's health against the RL troubleshooting playbook
(docs/troubleshooting.md). `evidence` reads the run, `checks` judges it, `main` prints."""
