"""Quality measurement: harness, datasets, metrics and the synthetic benchmark."""
