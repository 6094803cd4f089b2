"""The sidecar (control plane): REST jobs, the ledger, notices from connectors, delivery to trainers."""
