'use strict';
// Before `npm pack` (or `npm publish`): copies the contract, proto/mesh/v1/*.proto of the
// repository, into the package's own proto/ folder, which lib/mesh.js reads first. After it
// (`--remove`): takes the copy away again, so that in the repository the client always reads
// the contract as it is now, never a copy left over from an earlier pack.

const fs = require('node:fs');
const path = require('node:path');

const PACKAGE = path.resolve(__dirname, '..');
const BUNDLED = path.join(PACKAGE, 'proto');
const CONTRACT = path.resolve(PACKAGE, '..', '..', 'proto', 'mesh', 'v1');

fs.rmSync(BUNDLED, { recursive: true, force: true });
if (process.argv[2] !== '--remove') {
  const names = fs.readdirSync(CONTRACT).filter((name) => name.endsWith('.proto'));
  if (!names.length) throw new Error(`no .proto files in ${CONTRACT}`);
  const into = path.join(BUNDLED, 'mesh', 'v1');
  fs.mkdirSync(into, { recursive: true });
  for (const name of names) fs.copyFileSync(path.join(CONTRACT, name), path.join(into, name));
}
