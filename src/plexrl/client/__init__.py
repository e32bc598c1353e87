"""The library inside user scripts: connections, job handles, the embedded cluster."""
