"""`polyserve worker`: runs registration jobs claimed from the store's queue, serves no generations."""
