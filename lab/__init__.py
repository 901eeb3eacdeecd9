"""The lab: daemons, images and network namespaces that stand in for real hosts in tests and rehearsals."""
