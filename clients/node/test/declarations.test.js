'use strict';
// lib/mesh.d.ts against lib/mesh.js: what the declarations name is what the module gives, so
// that neither drifts from the other unseen. Read with the TypeScript compiler's own parser.

const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const protoLoader = require('@grpc/proto-loader');
const ts = require('typescript');
const mesh = require('../lib/mesh');

const DECLARATIONS = path.join(__dirname, '..', 'lib', 'mesh.d.ts');

/** The exported values of the declarations (classes with their methods), and interfaces. */
function declared() {
  const source = ts.createSourceFile(DECLARATIONS, fs.readFileSync(DECLARATIONS, 'utf8'),
    ts.ScriptTarget.Latest, true);
  const classes = new Map();
  const functions = new Set();
  const constants = new Set();
  const interfaces = new Map();
  const exported = (node) => (node.modifiers || [])
    .some((m) => m.kind === ts.SyntaxKind.ExportKeyword);
  for (const statement of source.statements) {
    if (!exported(statement)) continue;
    if (ts.isClassDeclaration(statement)) {
      const methods = statement.members.filter(ts.isMethodDeclaration).map((m) => m.name.text);
      classes.set(statement.name.text, [...new Set(methods)].sort());
    } else if (ts.isFunctionDeclaration(statement)) {
      functions.add(statement.name.text);
    } else if (ts.isVariableStatement(statement)) {
      for (const d of statement.declarationList.declarations) constants.add(d.name.text);
    } else if (ts.isInterfaceDeclaration(statement)) {
      interfaces.set(statement.name.text, statement.members
        .filter(ts.isPropertySignature).map((p) => p.name.text).sort());
    }
  }
  return { classes, functions, constants, interfaces };
}

test('the declarations name every export of lib/mesh.js, and nothing else', () => {
  const { classes, functions, constants } = declared();
  const names = [...classes.keys(), ...functions, ...constants].sort();
  assert.deepEqual(names, Object.keys(mesh).sort());
  for (const name of [...classes.keys(), ...functions]) {
    assert.equal(typeof mesh[name], 'function', name);
  }
  for (const name of constants) assert.notEqual(typeof mesh[name], 'function', name);
});

test('each declared class has the public methods of its implementation', () => {
  const { classes } = declared();
  for (const [name, methods] of classes) {
    const implemented = Object.getOwnPropertyNames(mesh[name].prototype)
      .filter((m) => m !== 'constructor' && !m.startsWith('_')).sort();
    assert.deepEqual(methods, implemented, name);
  }
});

test('a message as read off the wire has the fields its declaration gives it', () => {
  const { interfaces } = declared();
  // Through the wire: serialized as SendMessage's request and read back as the client reads.
  const definition = protoLoader.loadSync('mesh/v1/broker.proto', { includeDirs: [mesh.PROTO_ROOT],
    keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true });
  const { requestSerialize, requestDeserialize } = definition['mesh.v1.BrokerService'].SendMessage;
  const wire = mesh.buildMessage({ from: 'A', to: 'B', content: { n: 1 } });
  const read = mesh.readMessage(requestDeserialize(requestSerialize({ message: wire })).message);
  assert.deepEqual(Object.keys(read).sort(), interfaces.get('Message'));
  assert.equal(read.type, 'REQUEST');
  assert.equal(read.priority, 'MEDIUM');
  assert.deepEqual(read.content, { n: 1 });
});

test('content travels as JSON.stringify reads it; what JSON cannot carry is a TypeError', () => {
  const definition = protoLoader.loadSync('mesh/v1/broker.proto', { includeDirs: [mesh.PROTO_ROOT],
    keepCase: true, longs: Number, enums: String, defaults: true, oneofs: true });
  const { requestSerialize, requestDeserialize } = definition['mesh.v1.BrokerService'].SendMessage;
  const when = new Date(Date.UTC(2026, 10, 26, 12, 0, 0));
  const wire = mesh.buildMessage({ from: 'A', to: 'B',
    content: { action: 'book', when, legs: [{ at: when }], id: Number.MAX_SAFE_INTEGER } });
  const read = mesh.readMessage(requestDeserialize(requestSerialize({ message: wire })).message);
  assert.deepEqual(read.content, JSON.parse(JSON.stringify({ action: 'book', when,
    legs: [{ at: when }], id: Number.MAX_SAFE_INTEGER })));
  assert.equal(read.content.when, '2026-11-26T12:00:00.000Z');
  assert.throws(() => mesh.buildMessage({ from: 'A', to: 'B',
    content: { action: 'pay', orderId: 12345678901234567n } }),
  (err) => err instanceof TypeError && /BigInt 12345678901234567 .*send it as a string/.test(err.message));
  assert.throws(() => mesh.buildMessage({ from: 'A', to: 'B',
    content: { action: 'pay', then: () => 1 } }), /a function is not a JSON value/);
  // What would arrive as something else ({"0": "x"}, {}, a ttl of 1): refused, saying why.
  for (const [fields, said] of [
    [{ content: ['x'] }, /^content must be an object, not an array$/],
    [{ content: 'x' }, /^content must be an object, not a string$/],
    [{ content: { action: 'a' }, metadata: [1] }, /^metadata must be an object, not an array$/],
    [{ content: { action: 'a', m: new Map([['k', 1]]) } }, /a Map is not a JSON value: send an object/],
    [{ content: { action: 'a', s: new Set([1]) } }, /a Set is not a JSON value: send an array/],
    [{ content: { action: 'a', x: [NaN] } }, /^NaN is not a number JSON can write/],
    [{ content: { action: 'a', x: Infinity } }, /^Infinity is not a number JSON can write/],
    [{ content: { action: 'a', n: JSON.parse(`${'{"n":'.repeat(30)}1${'}'.repeat(30)}`) } },
      /^JSON content may nest at most 25 levels deep/],
    [{ content: { action: 'a' }, ttl: 1.5 }, /^ttl must be a whole number of seconds, not 1.5$/],
    [{ content: { action: 'a' }, ttl: '5' }, /^ttl must be a whole number of seconds, not "5"$/],
  ]) {
    assert.throws(() => mesh.buildMessage({ from: 'A', to: 'B', ...fields }),
      (err) => err instanceof TypeError && said.test(err.message), JSON.stringify(fields));
  }
});

test('a bare string where a list is asked, or a URL for an address, is a TypeError saying so',
  async () => {
    for (const [address, said] of [
      ['http://127.0.0.1:50051', /^http:\/\/127\.0\.0\.1:50051 is a URL, not a gRPC target: give host:port \(127\.0\.0\.1:50051; TLS/],
      ['GRPCS://broker.svc:443/', /is a URL, not a gRPC target: give host:port \(broker\.svc:443;/],
      ['127.0.0.1:99999', /^127\.0\.0\.1:99999: a port is from 1 to 65535$/],
      ['', /^an address is required/],
    ]) {
      for (const Client of [mesh.MeshClient, mesh.GatewayClient, mesh.AgentClient]) {
        assert.throws(() => new Client(address), (err) => err instanceof TypeError
          && said.test(err.message), `${Client.name} ${address}`);
      }
    }
    // Nothing is dialled for what is refused: no broker listens at port 1.
    const client = new mesh.MeshClient('127.0.0.1:1', { agentId: 'me', retryDelaysMs: [] });
    try {
      for (const [call, said] of [
        [() => client.register({ agentTypes: 'hotel' }), /^agentTypes is a list, not one string: write \["hotel"\]$/],
        [() => client.register({ capabilities: 'book' }), /^capabilities is a list, not one/],
        [() => client.broadcast({ alert: 'x' }, { agentTypes: 'hotel' }), /^agentTypes is a list/],
        [() => client.gather({ action: 'x' }, { agentIds: 'Hotel' }), /^agentIds is a list/],
        [() => client.gather({ action: 'x' }, { agentTypes: ['a', 1] }), /^agentTypes is a list of strings, not \["a",1\]$/],
        [() => client.readInsights({ tags: 'vote' }), /^tags is a list/],
        [() => client.writeInsight({ n: 1 }, { tags: 'vote' }), /^tags is a list/],
        [() => client.deleteInsights({ insightIds: 'i-1' }), /^insightIds is a list/],
        [() => client.requeueDeadLetters('Hotel', 'm-1'), /^messageIds is a list/],
        [() => client.negotiate('Hotel', { price: 1 }), /^peers is a list/],
      ]) {
        await assert.rejects(call(), (err) => err instanceof TypeError && said.test(err.message),
          String(said));
      }
    } finally {
      client.close();
    }
  });
