"""Generated code of the mesh.v1 contract (make proto); never edited by hand."""
