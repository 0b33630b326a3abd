//! What the agent knows about workloads (pods) in the mesh.
