"""The container payload: what /run.sh runs inside the submission image."""
