'use strict';
// A Node.js client and agent for agentmesh. It loads the same proto/mesh/v1/*.proto files as
// the Python code, with @grpc/proto-loader, and talks plain gRPC to the broker and gateway.

const fs = require('node:fs');
const path = require('node:path');
const crypto = require('node:crypto');
const util = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');
const { HealthImplementation, service: healthService } = require('grpc-health-check');
const { ReflectionService } = require('@grpc/reflection');
const { FileDescriptorProto } = require('protobufjs/ext/descriptor');

/** Where the contract's .proto files are read from: the package's own copy when it was
 * installed from a packed tarball (`npm pack` bundles them), else the repository's proto/. */
const PROTO_ROOT = [path.resolve(__dirname, '..', 'proto'), path.resolve(__dirname, '..', '..', '..', 'proto')]
  .find((root) => fs.existsSync(path.join(root, 'mesh', 'v1', 'broker.proto')))
  ?? path.resolve(__dirname, '..', '..', '..', 'proto');
const definition = protoLoader.loadSync(
  ['mesh/v1/broker.proto', 'mesh/v1/agent.proto', 'mesh/v1/gateway.proto', 'mesh/v1/memory.proto',
    'mesh/v1/tools.proto'],
  { includeDirs: [PROTO_ROOT], keepCase: true, longs: Number, enums: String, defaults: true,
    oneofs: true },
);
const meshV1 = grpc.loadPackageDefinition(definition).mesh.v1;
const encodeConnectFrame = definition['mesh.v1.BrokerService'].Connect.requestSerialize;
/** The most bytes of frames the client sends together as one batch frame (the broker reads
 * up to 8 MiB a frame; each message is at most 1 MiB). */
const BATCH_BYTES = 3 * 1024 * 1024;

/**
 * Writes the frames of a Connect stream: those written in one turn of the event loop go out
 * together, as batch frames of up to BATCH_BYTES, so that the broker reads them together
 * (one by one, it answers each before it reads the next). A frame that cannot be encoded is
 * left out and handed to refuse with the error; the others go. flush() writes what waits now
 * (before the stream is ended).
 */
function frameWriter(call, refuse) {
  let queued = [];
  const flush = () => {
    const frames = queued;
    queued = [];
    if (!frames.length || call.writableEnded || call.destroyed) return;
    if (frames.length === 1) {
      try {
        call.write(frames[0]);
      } catch (err) {
        refuse(frames[0], err);
      }
      return;
    }
    let batch = [];
    let bytes = 0;
    const out = () => {
      call.write(batch.length === 1 ? batch[0] : { batch: { frames: batch } });
      batch = [];
      bytes = 0;
    };
    for (const frame of frames) {
      let size;
      try {
        size = encodeConnectFrame(frame).length;
      } catch (err) {
        refuse(frame, err);
        continue;
      }
      if (batch.length && bytes + size > BATCH_BYTES) out();
      batch.push(frame);
      bytes += size;
    }
    if (batch.length) out();
  };
  return {
    write(frame) {
      if (queued.push(frame) === 1) queueMicrotask(flush);
    },
    flush,
  };
}
const HealthClient = grpc.makeGenericClientConstructor(healthService, 'Health');

// -- google.protobuf.Struct <-> plain JSON ---------------------------------------------------

/**
 * How deep JSON content may nest (objects and arrays in one another): the broker reads a
 * frame to 84 protobuf levels, and an object takes three of them, so content nests about 25
 * levels (as the Python SDK's documentation says). Deeper (or circular) content is a
 * TypeError here rather than a frame grpc-js cannot write, which ends the whole session.
 */
const MAX_JSON_DEPTH = 25;

/**
 * A google.protobuf.Value from a JSON value, read as JSON.stringify reads it (a Date, or
 * anything with toJSON, as what toJSON gives: a Date's ISO 8601 text). What JSON cannot carry
 * is a TypeError rather than something else arriving: NaN or Infinity (JSON has no way to
 * write them), a BigInt (a JSON number is a double; send it as a string), a function or a
 * symbol, nesting past MAX_JSON_DEPTH.
 */
function toValue(v, depth = 0) {
  if (v === null || v === undefined) return { nullValue: 'NULL_VALUE' };
  if (typeof v === 'boolean') return { boolValue: v };
  if (typeof v === 'number') {
    if (!Number.isFinite(v)) {
      throw new TypeError(`${v} is not a number JSON can write (NaN and Infinity are not)`);
    }
    return { numberValue: v };
  }
  if (typeof v === 'string') return { stringValue: wellFormed(v, 'a string') };
  if (Array.isArray(v)) {
    return { listValue: { values: v.map((item) => toValue(item, nested(depth))) } };
  }
  if (typeof v === 'bigint') {
    throw new TypeError(`the BigInt ${v} cannot travel as a JSON number (a double): `
      + 'send it as a string, or as a Number when it is within Number.MAX_SAFE_INTEGER');
  }
  if (typeof v !== 'object') throw new TypeError(`a ${typeof v} is not a JSON value`);
  if (typeof v.toJSON === 'function') return toValue(v.toJSON(), depth);
  if (v instanceof Map || v instanceof Set) {
    // (JSON.stringify writes either as {}: all that was in it lost)
    throw new TypeError(`a ${v.constructor.name} is not a JSON value: send `
      + (v instanceof Map ? 'an object (Object.fromEntries)' : 'an array'));
  }
  return { structValue: toStruct(v, 'a JSON object', nested(depth)) };
}

function nested(depth) {
  if (depth + 1 >= MAX_JSON_DEPTH) {
    throw new TypeError(`JSON content may nest at most ${MAX_JSON_DEPTH} levels deep `
      + '(is it circular?)');
  }
  return depth + 1;
}

/** A google.protobuf.Struct from a JSON object (null or undefined: an empty one). */
function toStruct(obj, field = 'a JSON object', depth = 0) {
  if (obj !== null && obj !== undefined && (typeof obj !== 'object' || Array.isArray(obj))) {
    throw new TypeError(`${field} must be an object, not ${
      Array.isArray(obj) ? 'an array' : `a ${typeof obj}`}`);
  }
  const fields = {};
  for (const [k, v] of Object.entries(obj || {})) {
    fields[wellFormed(k, `a key of ${field}`)] = toValue(v, depth);
  }
  return { fields };
}

/**
 * `value`, when UTF-8 can write it. A string holding a lone surrogate ('\ud800', what
 * JSON.parse makes of an unpaired escape) is a TypeError: the broker refuses a frame with
 * bad UTF-8 in it whole, and with it every frame of its batch.
 */
function wellFormed(value, what) {
  if (!value.isWellFormed()) {
    throw new TypeError(`${what}, ${JSON.stringify(value).slice(0, 60)}, is not text UTF-8 `
      + 'can write (it holds a lone surrogate)');
  }
  return value;
}

function fromValue(v) {
  if (!v) return null;
  switch (v.kind) {
    case 'structValue': return fromStruct(v.structValue);
    case 'listValue': return (v.listValue.values || []).map(fromValue);
    case 'numberValue': return v.numberValue;
    case 'stringValue': return v.stringValue;
    case 'boolValue': return v.boolValue;
    default: return null;
  }
}

function fromStruct(s) {
  const out = {};
  for (const [k, v] of Object.entries((s && s.fields) || {})) out[k] = fromValue(v);
  return out;
}

// -- messages ---------------------------------------------------------------------------------

const TYPES = ['REQUEST', 'RESPONSE', 'BROADCAST', 'HANDOFF', 'ERROR', 'ACK'];

function nowTimestamp() {
  const ms = Date.now();
  return { seconds: Math.floor(ms / 1000), nanos: (ms % 1000) * 1e6 };
}

const MESSAGE_TYPES = ['REQUEST', 'RESPONSE', 'BROADCAST', 'HANDOFF', 'ERROR', 'ACK'];
const PRIORITIES = ['HIGH', 'MEDIUM', 'LOW'];

/**
 * A mesh.v1.Message from a plain object: {from, to, type, content, priority, ...}. A type or
 * priority the contract does not have is a TypeError (it would travel as unset).
 */
function buildMessage(m) {
  if (m.type !== undefined && !MESSAGE_TYPES.includes(m.type)) {
    throw new TypeError(`type ${JSON.stringify(m.type)} is not one of ${MESSAGE_TYPES.join(', ')}`);
  }
  if (m.priority !== undefined && !PRIORITIES.includes(m.priority)) {
    throw new TypeError(
      `priority ${JSON.stringify(m.priority)} is not one of ${PRIORITIES.join(', ')}`);
  }
  if (m.ttl !== undefined && !Number.isInteger(m.ttl)) {
    throw new TypeError(`ttl must be a whole number of seconds, not ${JSON.stringify(m.ttl)}`);
  }
  const deliverAt = deliveryTime(m);
  for (const [field, value] of [['from', m.from], ['to', m.to], ['messageId', m.messageId],
    ['correlationId', m.correlationId], ['replyTo', m.replyTo],
    ...Object.entries(m.headers || {}).flatMap(([k, v]) => [['a header', k], ['a header', v]])]) {
    if (typeof value === 'string') wellFormed(value, field);
  }
  return {
    message_id: m.messageId || crypto.randomUUID(),
    from_agent: m.from,
    to_agent: m.to,
    // A REQUEST, or a BROADCAST when it goes to "broadcast", unless m.type says otherwise.
    message_type: `MESSAGE_TYPE_${m.type || (m.to === 'broadcast' ? 'BROADCAST' : 'REQUEST')}`,
    content: m.content === undefined ? undefined : toStruct(m.content, 'content'),
    timestamp: nowTimestamp(),
    metadata: toStruct(m.metadata, 'metadata'),
    correlation_id: m.correlationId || '',
    priority: `PRIORITY_${m.priority || 'MEDIUM'}`,
    ttl: m.ttl || 0,
    reply_to: m.replyTo || '',
    ack_required: Boolean(m.ackRequired),
    headers: m.headers || {},
    ...(deliverAt === null ? {} : { deliver_at: deliverAt }),
  };
}

/**
 * When a message is scheduled for (m.deliverAt: a Date or an ISO 8601 string; m.delayMs:
 * milliseconds from now), as a Timestamp; null for at once. Both, or either unreadable, is a
 * TypeError.
 */
function deliveryTime(m) {
  if (m.deliverAt !== undefined && m.delayMs !== undefined) {
    throw new TypeError('give deliverAt or delayMs, not both');
  }
  let ms;
  if (m.delayMs !== undefined) {
    ms = Date.now() + checkWait(m.delayMs, 'delayMs');
  } else if (m.deliverAt !== undefined) {
    ms = m.deliverAt instanceof Date ? m.deliverAt.getTime()
      : typeof m.deliverAt === 'string' ? Date.parse(m.deliverAt) : NaN;
    if (!Number.isFinite(ms)) {
      throw new TypeError(
        `deliverAt must be a Date or an ISO 8601 time, not ${JSON.stringify(m.deliverAt)}`);
    }
  } else {
    return null;
  }
  return { seconds: Math.floor(ms / 1000), nanos: (((ms % 1000) + 1000) % 1000) * 1e6 };
}

/** A google.protobuf.Timestamp in ISO 8601, or null. */
function isoTime(ts) {
  return ts ? new Date(Number(ts.seconds) * 1000 + ts.nanos / 1e6).toISOString() : null;
}

/** The default negotiation policy: the counters' terms are taken over, peer by peer. */
function adoptCounters(terms, counters) {
  return counters.reduce((next, c) => ({ ...next, ...(c.proposal || {}) }), { ...terms });
}

/** A peer's answer to a proposal; anything unreadable is a rejection that says why. */
function readReply(peer, content) {
  const c = content || {};
  const decision = String(c.decision || '').toLowerCase();
  const reason = typeof c.reason === 'string' ? c.reason : '';
  if (!['accept', 'reject', 'counter'].includes(decision)) {
    return { peer, decision: 'reject', reason: `unreadable decision ${JSON.stringify(c.decision)}` };
  }
  if (decision === 'counter' && (typeof c.proposal !== 'object' || c.proposal === null)) {
    return { peer, decision: 'reject', reason: 'a counter without a proposal object' };
  }
  return { peer, decision, proposal: decision === 'counter' ? c.proposal : null, reason };
}

/** A plain object from a mesh.v1.Insight. */
function readInsight(pb) {
  return { insightId: pb.insight_id, agentId: pb.agent_id, content: fromValue(pb.content),
    tags: pb.tags, importance: pb.importance, segment: pb.segment,
    metadata: fromStruct(pb.metadata), createdAt: isoTime(pb.created_at),
    ttlMs: pb.ttl ? Number(pb.ttl.seconds) * 1000 + pb.ttl.nanos / 1e6 : 0,
    expiresAt: isoTime(pb.expires_at) };
}

/** A plain object from a mesh.v1.AgentInfo. */
function readAgent(pb) {
  return { agentId: pb.agent_id, agentTypes: pb.agent_types, address: pb.address,
    capabilities: pb.capabilities, registeredAt: isoTime(pb.registered_at),
    instances: pb.instances || [], lostAt: pb.lost_at ? isoTime(pb.lost_at) : null,
    deliveryMode: String(pb.delivery_mode || 'DELIVERY_MODE_PULL').replace('DELIVERY_MODE_', '')
      .replace('UNSPECIFIED', 'PULL'),
    maxInFlight: pb.max_in_flight || 0, pushInstances: pb.push_instances || [],
    requiredFields: pb.required_fields || [] };
}

const DELIVERY_MODES = ['PULL', 'PUSH'];

const CHANGE_KINDS = new Set(['current', 'synced', 'put', 'delete', 'lapse']);
const RECONNECT_DELAYS_MS = [100, 250, 500, 1000, 2000];

/**
 * What a resumed watch missed: a 'put' of each entry written meanwhile (its latest
 * version), then a 'delete' of each one gone (its last version as the watcher saw it), each
 * in key order; known becomes the entries now.
 */
function* catchUp(known, current) {
  const now = new Map(current.map((entry) => [entry.key, entry]));
  const byKey = (a, b) => (a[0] < b[0] ? -1 : 1);
  const missed = [
    ...[...now].sort(byKey).filter(([key, entry]) => !util.isDeepStrictEqual(known.get(key), entry))
      .map(([, entry]) => ({ kind: 'put', entry })),
    ...[...known].sort(byKey).filter(([key]) => !now.has(key))
      .map(([, entry]) => ({ kind: 'delete', entry })),
  ];
  known.clear();
  for (const [key, entry] of now) known.set(key, entry);
  yield* missed;
}

/** A plain object from a mesh.v1.StateEntry. */
function readEntry(pb) {
  return { key: pb.key, value: fromValue(pb.value), version: Number(pb.version),
    updatedBy: pb.updated_by, updatedAt: isoTime(pb.updated_at),
    expiresAt: isoTime(pb.expires_at) };
}

/**
 * The hand-off a HANDOFF message carries (RT-011): what the next agent should do, the context
 * gathered so far, the previous agent's result, the constraints, and the workflow's step.
 */
function readHandoff(content, metadata) {
  const params = content && typeof content.parameters === 'object' && content.parameters !== null
    ? content.parameters : {};
  const object = (v) => (typeof v === 'object' && v !== null && !Array.isArray(v) ? v : {});
  const step = metadata.step_number ?? metadata.handoff_step;
  return {
    taskDescription: String(params.task_description || ''),
    context: object(params.context),
    previousResult: params.previous_result === undefined ? null : params.previous_result,
    constraints: object(params.constraints),
    workflowId: String(metadata.workflow_id || ''),
    stepNumber: typeof step === 'number' ? step : 0,
  };
}

/** A plain object from a mesh.v1.Message (a HANDOFF's payload read out as `handoff`). */
function readMessage(pb) {
  let type = String(pb.message_type).replace('MESSAGE_TYPE_', '');
  if (type === 'UNSPECIFIED') type = pb.to_agent === 'broadcast' ? 'BROADCAST' : 'REQUEST';
  let priority = String(pb.priority).replace('PRIORITY_', '');
  if (priority === 'UNSPECIFIED') priority = 'MEDIUM';
  const content = pb.content ? fromStruct(pb.content) : null;
  const metadata = fromStruct(pb.metadata);
  return {
    messageId: pb.message_id,
    from: pb.from_agent,
    to: pb.to_agent,
    type,
    content,
    timestamp: isoTime(pb.timestamp),
    metadata,
    correlationId: pb.correlation_id,
    priority,
    ttl: pb.ttl,
    replyTo: pb.reply_to,
    ackRequired: pb.ack_required,
    headers: pb.headers || {},
    deliverAt: isoTime(pb.deliver_at),
    handoff: type === 'HANDOFF' ? readHandoff(content, metadata) : null,
  };
}

// The rich status every mesh server sends with an error (the grpc-status-details-bin
// trailer): google.rpc.Status with ErrorInfo, BadRequest and RetryInfo details.
const RPC = protobuf.Root.fromJSON({ nested: { google: { nested: {
  protobuf: { nested: {
    Any: { fields: { type_url: { type: 'string', id: 1 }, value: { type: 'bytes', id: 2 } } },
    Duration: { fields: { seconds: { type: 'int64', id: 1 }, nanos: { type: 'int32', id: 2 } } },
  } },
  rpc: { nested: {
    Status: { fields: { code: { type: 'int32', id: 1 }, message: { type: 'string', id: 2 },
      details: { rule: 'repeated', type: 'google.protobuf.Any', id: 3 } } },
    ErrorInfo: { fields: { reason: { type: 'string', id: 1 }, domain: { type: 'string', id: 2 } } },
    BadRequest: { nested: { FieldViolation: { fields: { field: { type: 'string', id: 1 },
      description: { type: 'string', id: 2 } } } },
    fields: { field_violations: { rule: 'repeated', type: 'FieldViolation', id: 1 } } },
    RetryInfo: { fields: { retry_delay: { type: 'google.protobuf.Duration', id: 1 } } },
  } },
} } } });
const DETAIL_TYPES = Object.fromEntries(['ErrorInfo', 'BadRequest', 'RetryInfo']
  .map((name) => [`type.googleapis.com/google.rpc.${name}`, RPC.lookupType(`google.rpc.${name}`)]));

/** What a failed call's google.rpc.Status says: {reason, fieldViolations, retryAfterMs}. */
function richStatus(metadata) {
  const found = { reason: '', fieldViolations: [], retryAfterMs: null };
  const [raw] = (metadata && typeof metadata.get === 'function')
    ? metadata.get('grpc-status-details-bin') : [];
  if (!raw) return found;
  try {
    for (const detail of RPC.lookupType('google.rpc.Status').decode(raw).details) {
      const type = DETAIL_TYPES[detail.type_url];
      if (!type) continue;
      const value = type.decode(detail.value);
      if (detail.type_url.endsWith('ErrorInfo')) found.reason = value.reason;
      if (detail.type_url.endsWith('BadRequest')) {
        found.fieldViolations = value.field_violations.map((v) => ({ field: v.field,
          description: v.description }));
      }
      if (detail.type_url.endsWith('RetryInfo') && value.retry_delay) {
        found.retryAfterMs = Number(value.retry_delay.seconds || 0) * 1000
          + (value.retry_delay.nanos || 0) / 1e6;
      }
    }
  } catch (err) {
    // an unreadable trailer: the code and message still stand
  }
  return found;
}

/** What a message called to an agent's own server may be at most, as the broker and the
 * Python agents hold it (RT-011's defaults). */
const DIRECT_LIMITS = { messageBytes: 1024 * 1024, ttl: 86400 };
/** A google.protobuf.Timestamp's range: 0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z. */
const TIMESTAMP_SECONDS = [-62135596800, 253402300799];
/** The symbol under which an agent server's deserializer keeps the bytes of a call's
 * message (its size), or why the call could not be read. */
const WIRE = Symbol('wire');

/**
 * What in a message called to an agent's own server the Python agents refuse before their
 * handler runs, from its wire form (pb, as read) and its size in bytes: a type or priority
 * the contract does not define, a timestamp (or deliver_at) out of a Timestamp's range, a
 * deliver_at more than a day ahead, a ttl that is negative or past a day, a message past 1 MiB, and a number JSON cannot write (NaN,
 * Infinity). Each a [field, description] pair.
 */
function wireViolations(pb, bytes) {
  const found = [];
  const undefinedEnum = (field, value, prefix, names) => {
    if (!String(value).startsWith(prefix)) {
      const known = names.map((name, i) => `${name}=${i + 1}`).join(', ');
      found.push([field, `${field} ${value} is not defined (known: ${known})`]);
    }
  };
  undefinedEnum('message_type', pb.message_type, 'MESSAGE_TYPE_', MESSAGE_TYPES);
  undefinedEnum('priority', pb.priority, 'PRIORITY_', PRIORITIES);
  for (const [field, ts] of [['timestamp', pb.timestamp], ['deliver_at', pb.deliver_at]]) {
    if (ts && !(ts.seconds >= TIMESTAMP_SECONDS[0] && ts.seconds <= TIMESTAMP_SECONDS[1]
      && ts.nanos >= 0 && ts.nanos <= 999999999)) {
      found.push([field, `${field} must be from 0001-01-01T00:00:00Z to `
        + `9999-12-31T23:59:59.999999999Z (seconds ${ts.seconds}, nanos ${ts.nanos})`]);
    } else if (field === 'deliver_at' && ts
      && Number(ts.seconds) * 1000 + ts.nanos / 1e6 - Date.now() > DIRECT_LIMITS.ttl * 1000) {
      found.push([field, `deliver_at must be at most ${DIRECT_LIMITS.ttl} seconds ahead`]);
    }
  }
  if (pb.ttl < 0) found.push(['ttl', 'ttl must not be negative']);
  if (pb.ttl > DIRECT_LIMITS.ttl) {
    found.push(['ttl', `ttl must be at most ${DIRECT_LIMITS.ttl} seconds`]);
  }
  if (bytes > DIRECT_LIMITS.messageBytes) {
    found.push(['message',
      `message is ${bytes} bytes; the limit is ${DIRECT_LIMITS.messageBytes} bytes`]);
  }
  for (const [name, struct] of [['content', pb.content], ['metadata', pb.metadata]]) {
    const where = nonFinite(struct && { kind: 'structValue', structValue: struct },
      `message.${name}`);
    if (where) { // (said as the Python agents say it: their decoder refuses it)
      found.push([where, 'the request is not a valid mesh.v1.HandleMessageRequest: '
        + `${where} is NaN or Infinity, which JSON has no way to write`]);
    }
  }
  return found;
}

/** Where in a google.protobuf.Value (as read) a number is NaN or Infinity, or null. */
function nonFinite(value, at) {
  if (!value) return null;
  if (value.kind === 'numberValue') return Number.isFinite(value.numberValue) ? null : at;
  const inner = value.kind === 'structValue'
    ? Object.entries((value.structValue && value.structValue.fields) || {})
    : value.kind === 'listValue'
      ? ((value.listValue && value.listValue.values) || []).map((v, i) => [i, v])
      : [];
  for (const [key, item] of inner) {
    const found = nonFinite(item, `${at}.${key}`);
    if (found) return found;
  }
  return null;
}

/**
 * An agent server's service definition: each method's requests read by the contract's
 * deserializer, a request that cannot be read kept as why (WIRE) for its handler to refuse
 * INVALID_ARGUMENT (grpc-js would answer INTERNAL), and a HandleMessage's message size kept
 * beside it (the bytes of field 1, as the Python agents count it).
 */
function readableService(service) {
  return Object.fromEntries(Object.entries(service).map(([name, method]) => [name, {
    ...method,
    requestDeserialize: (buffer) => {
      try {
        const request = method.requestDeserialize(buffer);
        request[WIRE] = { bytes: messageBytes(buffer) };
        return request;
      } catch (err) {
        const [, service, rpc] = method.path.split('/'); // ('/mesh.v1.AgentService/HandleMessage')
        const type = `${service.slice(0, service.lastIndexOf('.') + 1)}${rpc}Request`;
        return { [WIRE]: { unreadable: `the request is not a valid ${type}: ${err.message}` } };
      }
    },
  }]));
}

/** A HandleMessageRequest's message when it has none: an empty one, as read. */
const NO_MESSAGE = meshV1.AgentService.service.HandleMessage
  .requestDeserialize(Buffer.from([0x0a, 0x00])).message;

/** The size of field 1 (a HandleMessageRequest's message) in a request's bytes; 0 without. */
function messageBytes(buffer) {
  if (buffer.length < 2 || buffer[0] !== 0x0a) return 0;
  let size = 0;
  for (let i = 1, shift = 0; i < buffer.length && i < 6; i += 1, shift += 7) {
    size += (buffer[i] & 0x7f) * 2 ** shift;
    if (!(buffer[i] & 0x80)) return size;
  }
  return 0;
}

/**
 * What keeps a message called to an agent's own server from being handled, as the broker
 * would refuse it ([field, description] pairs): RT-011's required fields, the content keys the
 * agent requires (of a REQUEST or HANDOFF), and an agent id other than the one the server serves.
 */
function directViolations(message, agentId, requiredFields = []) {
  const found = [];
  if (!message.from) found.push(['from_agent', 'from_agent is required']);
  if (!message.to) found.push(['to_agent', 'to_agent is required']);
  if (message.content === null) {
    found.push(['content', 'content is required']);
  } else {
    const { action, parameters } = message.content;
    if (action === undefined || action === null || action === '') {
      if (message.type !== 'BROADCAST') found.push(['content.action', 'content.action is required']);
    } else if (typeof action !== 'string') {
      found.push(['content.action', 'content.action must be a string']);
    }
    if (message.type === 'HANDOFF' && !(parameters && parameters.task_description)) {
      found.push(['content.parameters.task_description', 'task_description is required for handoff']);
    }
    if (message.type === 'REQUEST' || message.type === 'HANDOFF') {
      for (const key of requiredFields) {
        const value = Object.hasOwn(message.content, key) ? message.content[key] : undefined;
        if (value === undefined || value === null) {
          found.push([`content.${key}`, `content.${key} is required by ${agentId}`]);
        }
      }
    }
  }
  if (message.to && message.to !== agentId) {
    found.push(['to_agent', `this server serves ${agentId}, not ${message.to}`]);
  }
  return found;
}

/** An INVALID_ARGUMENT for a server's callback, with the rich status the mesh's servers send. */
function invalidArgument(violations) {
  const details = violations.map(([, description]) => description).join('; ');
  return richError(grpc.status.INVALID_ARGUMENT, details,
    { reason: 'VALIDATION_FAILED', violations });
}

/**
 * An error for a server's callback with the rich status the mesh's servers send (the
 * grpc-status-details-bin trailer): an ErrorInfo of reason, a BadRequest of violations
 * ([field, description] pairs) and a RetryInfo of retryAfterMs, each when given.
 */
function richError(code, details, { reason, violations = [], retryAfterMs } = {}) {
  const pack = (name, value) => ({ type_url: `type.googleapis.com/google.rpc.${name}`,
    value: RPC.lookupType(`google.rpc.${name}`).encode(value).finish() });
  const parts = [pack('ErrorInfo', { reason, domain: 'agentmesh.dev' })];
  if (violations.length) {
    parts.push(pack('BadRequest', { field_violations: violations.map(([field, description]) => ({
      field, description })) }));
  }
  if (retryAfterMs !== undefined) {
    parts.push(pack('RetryInfo', { retry_delay: toDuration(retryAfterMs) }));
  }
  const status = RPC.lookupType('google.rpc.Status').encode({ code, message: details,
    details: parts }).finish();
  const metadata = new grpc.Metadata();
  metadata.add('grpc-status-details-bin', Buffer.from(status));
  return { code, details, metadata };
}

/**
 * Errors carry the gRPC status code and what the mesh says of them: its machine-readable
 * reason (e.g. QUEUE_FULL, TOOL_NOT_ALLOWED), the fields that failed validation, and how long
 * to wait before trying again (backpressure), from the call's rich status or from the error
 * an answer carries.
 */
class MeshError extends Error {
  constructor(grpcError) {
    super(MeshError.said(grpcError));
    this.code = grpcError.code;
    this.codeName = Object.keys(grpc.status).find((k) => grpc.status[k] === grpcError.code);
    const rich = richStatus(grpcError.metadata);
    this.reason = grpcError.reason || rich.reason;
    this.fieldViolations = grpcError.fieldViolations || rich.fieldViolations;
    this.retryAfterMs = grpcError.retryAfterMs ?? rich.retryAfterMs;
  }

  /**
   * The error's text. gRPC's own bare "Method not found!" (no rich status: no server of the
   * mesh sent it) means the address is of a server without that service: said so.
   */
  static said(grpcError) {
    const text = grpcError.details || grpcError.message;
    const [rich] = (grpcError.metadata && typeof grpcError.metadata.get === 'function')
      ? grpcError.metadata.get('grpc-status-details-bin') : [];
    if (grpcError.code !== grpc.status.UNIMPLEMENTED || rich || grpcError.reason) return text;
    return `${text}: the server at this address does not serve this call; is it the right `
      + 'address? (the broker, the gateway and each agent serve different services)';
  }
}

/** A MeshError from a mesh.v1.Error carried in an answer (a batch's result, a gather's). */
function errorFrom(pb) {
  const delay = pb.retry_delay;
  return new MeshError({ code: pb.code, details: pb.message, reason: pb.reason,
    fieldViolations: (pb.field_violations || []).map((v) => ({ field: v.field,
      description: v.description })),
    retryAfterMs: delay ? Number(delay.seconds) * 1000 + delay.nanos / 1e6 : null });
}

/** An object's keys in camelCase (the proto's snake_case field names). */
function camelKeys(obj) {
  return Object.fromEntries(Object.entries(obj || {})
    .map(([k, v]) => [k.replace(/_([a-z0-9])/g, (_, c) => c.toUpperCase()), v]));
}

/**
 * Thrown by a handler for a message it can never process (no handler for its action, content
 * it cannot read): the message goes to the dead-letter queue at once with this reason instead
 * of being redelivered. (A REQUEST is still answered with an ERROR.)
 */
class Reject extends Error {
  constructor(reason) {
    super(reason);
    this.name = 'Reject';
  }
}

/** The longest wait a broker takes by default for a message handed back for later (a day). */
const LONGEST_RETRY_LATER_MS = 86400000;

/**
 * Thrown by a handler for a message it cannot handle yet (a rate limit met, a resource not
 * ready): the message goes back to the broker and comes again afterMs from now (a nack's
 * redeliver_after), to whichever instance of the agent is free then, its place in flight
 * taking the agent's other messages meanwhile. Whatever its type: a requester waits on (within
 * its own timeout), and nothing is answered now. The delivery counts as an attempt: after the
 * broker's last, the message goes to the dead-letter queue. Called directly (by the broker's
 * push, or a caller of the agent's own server), the agent answers UNAVAILABLE, reason
 * RETRY_LATER, with the wait in a RetryInfo. As the Python SDK's RetryLater.
 */
class RetryLater extends Error {
  constructor(afterMs, reason = '') {
    if (typeof afterMs !== 'number' || !(afterMs > 0 && afterMs <= LONGEST_RETRY_LATER_MS)) {
      throw new RangeError('RetryLater takes the milliseconds to wait, more than 0 and at most '
        + `${LONGEST_RETRY_LATER_MS}, not ${String(afterMs)}`);
    }
    super(reason || `retry in ${afterMs} ms`);
    this.name = 'RetryLater';
    this.afterMs = afterMs;
  }
}

/** A nack of the message a handler threw err on: RetryLater's wait, Reject's reason. */
function nackOf(agentId, messageId, err) {
  const nack = { agent_id: agentId, message_ids: [messageId] };
  if (err instanceof Reject) nack.dead_letter_reason = err.message;
  if (err instanceof RetryLater) nack.redeliver_after = toDuration(err.afterMs);
  return nack;
}

// -- TLS and credentials ----------------------------------------------------------------------

/** How often a client or an agent's server looks at the files it reads again (a stat of
 * each): its token file, its TLS files, its credentials file. */
const LOOK_MS = 1000;

/**
 * Files, and what load() makes of them (a TypeError saying why it cannot), read again when
 * they change, as the Python SDK's WatchedFiles: renewed in place (cert-manager rewriting a
 * Secret's volume, a token rotated, a credentials file edited). Loaded as it is made (the
 * error thrown); looked at every LOOK_MS while anyone listens (listen() returns the way to
 * stop), and what changed is loaded, then handed to the listeners when it differs from what
 * they had. Files changed into what cannot be used (written halfway, a key that is not the
 * certificate's, JSON cut short) are said once, and what was read before stays in use.
 */
class WatchedFiles {
  constructor(what, paths, load, same = (a, b) => a === b) {
    this.what = what;
    this.paths = paths.filter(Boolean);
    this.load = load;
    this.same = same;
    this.current = load();
    this.problem = null;
    this.listeners = new Set();
    this.look = () => this.lookAgain();
  }

  lookAgain() {
    let loaded;
    try {
      loaded = this.load();
    } catch (err) {
      if (err.message !== this.problem) {
        this.problem = err.message;
        console.warn(`${this.what} changed into what cannot be used, so what was read before `
          + `stays in use: ${err.message}`);
      }
      return;
    }
    this.problem = null;
    if (this.same(loaded, this.current)) return;
    const was = this.current;
    this.current = loaded;
    this.listeners.forEach((heard) => heard(loaded, was));
  }

  /** Calls heard(now, before) with what the files hold each time they change; returns the
   * way to stop. (fs.watchFile compares each file's stat with the one before.) */
  listen(heard) {
    if (!this.listeners.size) {
      this.paths.forEach((p) => fs.watchFile(p, { interval: LOOK_MS, persistent: false }, this.look));
    }
    this.listeners.add(heard);
    return () => {
      if (!this.listeners.delete(heard) || this.listeners.size) return;
      this.paths.forEach((p) => fs.unwatchFile(p, this.look));
    };
  }
}

/** The token a token file holds (its text, trimmed); a TypeError when it holds none. */
function readToken(path) {
  const token = fs.readFileSync(path, 'utf8').trim();
  if (!token) throw new TypeError(`the token file ${path} is empty`);
  return token;
}

const PEM_CERTIFICATE = /-----BEGIN CERTIFICATE-----[^-]+-----END CERTIFICATE-----/g;

function readFile(path) {
  try {
    return fs.readFileSync(path);
  } catch (err) {
    throw new TypeError(`cannot read ${path}: ${err.code || err.message}`);
  }
}

/** The certificates of a PEM text (none when it holds none it can read). */
function certificatesOf(pem) {
  try {
    return (pem.toString('latin1').match(PEM_CERTIFICATE) || [])
      .map((block) => new crypto.X509Certificate(block));
  } catch {
    return [];
  }
}

/** Why cert and key are not a PEM certificate (or a chain, the certificate first) and its
 * unencrypted private key; null when they are. */
function pairProblem(cert, key) {
  const [leaf] = certificatesOf(cert);
  if (!leaf) return 'the certificate is not PEM';
  if (/ENCRYPTED/.test(key.toString('latin1'))) {
    return 'the key is encrypted (TLS here takes an unencrypted key)';
  }
  let privateKey;
  try {
    privateKey = crypto.createPrivateKey(key);
  } catch {
    return 'the key is not a PEM private key';
  }
  return leaf.checkPrivateKey(privateKey) ? null : "the key is not the certificate's";
}

/** A CA bundle, its certificate and key, read and checked as TLS will use them: a TypeError
 * naming the file that cannot be read or is not what it should be. */
function readTls({ ca, cert, key }) {
  const files = {};
  if (ca) {
    files.ca = readFile(ca);
    if (!certificatesOf(files.ca).length) throw new TypeError(`the CA ${ca} is not a PEM certificate`);
  }
  if (cert) {
    files.cert = readFile(cert);
    files.key = readFile(key);
    const problem = pairProblem(files.cert, files.key);
    if (problem) {
      throw new TypeError(
        `${cert} and ${key} are not a PEM certificate and its private key: ${problem}`);
    }
  }
  return files;
}

/**
 * TLS files renewed in place, as grpc-js's certificate providers give them to its channels and
 * servers: a CA bundle (ca), a certificate and its key (cert, key), either or both. Read and
 * checked as TLS will use them (readTls) as it is made and again when they change
 * (WatchedFiles): the connections made after use what changed, those already open keep theirs.
 */
class WatchedCertificates {
  constructor({ ca, cert, key }, what = 'the TLS files') {
    if (Boolean(cert) !== Boolean(key)) {
      throw new TypeError(`${what}: a certificate needs its key, and a key its certificate `
        + `(got ${cert ? `certificate ${cert}` : `key ${key}`} alone)`);
    }
    const bytes = (x, y) => (x && y ? x.equals(y) : x === y);
    this.caChanged = (now, before) => !bytes(now.ca, before.ca);
    this.identityChanged = (now, before) => !bytes(now.cert, before.cert)
      || !bytes(now.key, before.key);
    this.files = new WatchedFiles(what, [ca, cert, key], () => readTls({ ca, cert, key }),
      (x, y) => !this.caChanged(x, y) && !this.identityChanged(x, y));
    this.stops = new Map(); // (each listener's way to stop)
  }

  caUpdate(files = this.files.current) {
    return files.ca ? { caCertificate: files.ca } : null;
  }

  identityUpdate(files = this.files.current) {
    return files.cert ? { certificate: files.cert, privateKey: files.key } : null;
  }

  added(listener, update, changed) {
    this.stops.set(listener, this.files.listen((now, before) => {
      if (changed(now, before)) listener(update(now));
    }));
    process.nextTick(() => listener(update()));
  }

  removed(listener) {
    const stop = this.stops.get(listener);
    this.stops.delete(listener);
    if (stop) stop();
  }

  addCaCertificateListener(listener) {
    this.added(listener, (f) => this.caUpdate(f), this.caChanged);
  }

  removeCaCertificateListener(listener) {
    this.removed(listener);
  }

  addIdentityCertificateListener(listener) {
    this.added(listener, (f) => this.identityUpdate(f), this.identityChanged);
  }

  removeIdentityCertificateListener(listener) {
    this.removed(listener);
  }
}

/**
 * Channel credentials and call metadata from options, else the same AGENTMESH_* variables the
 * Python SDK reads: tlsCa (AGENTMESH_TLS_CA) turns TLS on, tlsClientCert/tlsClientKey
 * (AGENTMESH_TLS_CLIENT_CERT/_KEY) add a client certificate for mutual TLS, token
 * (AGENTMESH_TOKEN) is sent as `authorization: Bearer <token>` on every call. tokenFile
 * (AGENTMESH_TOKEN_FILE), in place of a token, names a file holding it, looked at again every
 * LOOK_MS: a rotated token is sent from then on, without a restart (a file changed into
 * one that holds none is said, and the token before stays). stop() ends the looking. The CA
 * and the client certificate are looked at again too, every LOOK_MS while the channel
 * lives (WatchedCertificates): a connection made after their renewal uses them.
 */
function security(options = {}) {
  const env = process.env;
  const tlsCa = options.tlsCa ?? env.AGENTMESH_TLS_CA;
  const cert = options.tlsClientCert ?? env.AGENTMESH_TLS_CLIENT_CERT;
  const key = options.tlsClientKey ?? env.AGENTMESH_TLS_CLIENT_KEY;
  const tokenFile = options.tokenFile
    ?? (options.token === undefined ? env.AGENTMESH_TOKEN_FILE : undefined);
  const watched = tokenFile
    ? new WatchedFiles(`the token file ${tokenFile}`, [tokenFile], () => readToken(tokenFile))
    : null;
  const token = watched ? watched.current : (options.token ?? env.AGENTMESH_TOKEN);
  let credentials = grpc.credentials.createInsecure();
  if (tlsCa) {
    const files = new WatchedCertificates({ ca: tlsCa, cert, key }, "the client's TLS files");
    credentials = grpc.experimental.createCertificateProviderChannelCredentials(
      files, cert ? files : null);
  }
  const metadata = new grpc.Metadata();
  if (token) metadata.set('authorization', `Bearer ${token}`);
  // Each client keeps its connection to itself (in grpc-js's process-wide pool a new client
  // shares, with any other client of the process to the same address, that one's reconnect
  // backoff: its first calls failed at once though the server was back up), and reconnects
  // quickly after a broker restart: the retry delays, not the channel, set the pace.
  const channelOptions = {
    'grpc.use_local_subchannel_pool': 1,
    'grpc.initial_reconnect_backoff_ms': 100,
    'grpc.max_reconnect_backoff_ms': 2000,
  };
  const serverName = options.tlsServerName ?? env.AGENTMESH_TLS_SERVER_NAME;
  if (serverName) channelOptions['grpc.ssl_target_name_override'] = serverName;
  // The calls share this metadata (a session clones it as it opens): set in place, the new
  // token goes with every call made after.
  const stop = watched
    ? watched.listen((renewed) => metadata.set('authorization', `Bearer ${renewed}`))
    : () => {};
  return { credentials, metadata, channelOptions, stop };
}

/** An agent's server's TLS files, from options, else AGENTMESH_*: its certificate and key,
 * and the CA its callers' certificates must be signed by when it requires them (mutual). */
function serverTlsFiles(options) {
  const env = process.env;
  const cert = options.tlsCert ?? env.AGENTMESH_TLS_CERT;
  const key = options.tlsKey ?? env.AGENTMESH_TLS_KEY;
  const clientAuth = options.tlsClientAuth ?? (env.AGENTMESH_TLS_CLIENT_AUTH || 'require');
  if (!['require', 'none'].includes(clientAuth)) {
    throw new TypeError(`tlsClientAuth must be require or none, not ${JSON.stringify(clientAuth)}`);
  }
  const ca = cert && clientAuth === 'require' ? options.tlsCa ?? env.AGENTMESH_TLS_CA : undefined;
  return { cert, key, ca, mutual: Boolean(cert && ca) };
}

/**
 * Credentials for an agent's own server, from options, else the variables a Python agent's
 * server reads: TLS when tlsCert and tlsKey (AGENTMESH_TLS_CERT/_KEY) name its certificate
 * and key, mutual TLS when tlsCa (AGENTMESH_TLS_CA) names the CA its callers' certificates
 * must be signed by, unless tlsClientAuth (AGENTMESH_TLS_CLIENT_AUTH) is 'none' (the CA is
 * then its client's alone); plaintext without them. The files are looked at again every
 * LOOK_MS (WatchedCertificates): a renewed certificate is used from the next connection
 * on.
 */
function serverCredentials(options = {}) {
  const { cert, key, ca } = serverTlsFiles(options);
  if (!cert && !key) return grpc.ServerCredentials.createInsecure();
  const files = new WatchedCertificates({ ca, cert, key }, "the agent's server TLS files");
  // (grpc-js 1.14 takes this function's first provider for the certificate and its second
  // for the CA, whatever its declaration calls them: the order here is the one it uses, and
  // tests/integration/test_node_client.py serves TLS without a CA to hold it to that.)
  return grpc.experimental.createCertificateProviderServerCredentials(
    files, ca ? files : null, Boolean(ca));
}

/**
 * The principals of a credentials file (the format the broker reads: {"principals": [{name,
 * token or token_sha256, agents, admin}]}), by their token's SHA-256 digest in hex (byDigest)
 * and by name (byName, for a client certificate's); a TypeError saying what is wrong with it.
 */
function readCredentials(path) {
  let data;
  try {
    data = JSON.parse(fs.readFileSync(path, 'utf8'));
  } catch (err) {
    throw new TypeError(`cannot read the credentials file ${path}: ${err.message}`);
  }
  if (data === null || typeof data !== 'object' || Array.isArray(data)) {
    throw new TypeError('the credentials must be a JSON object, with "principals": a list');
  }
  const principals = data.principals || [];
  if (!Array.isArray(principals)) throw new TypeError('principals must be a list of objects');
  const byDigest = new Map();
  const byName = new Map();
  principals.forEach((item, index) => {
    if (item === null || typeof item !== 'object' || Array.isArray(item)) {
      throw new TypeError(`principals[${index}] must be an object`);
    }
    const name = String(item.name || '');
    if (!name) throw new TypeError(`principals[${index}] has no name`);
    const agents = item.agents || [];
    if (!Array.isArray(agents) || !agents.every((a) => typeof a === 'string')) {
      throw new TypeError(`principals[${index}].agents must be a list of agent ids`);
    }
    const { token, token_sha256: digest } = item;
    if (token !== undefined && digest !== undefined) {
      throw new TypeError(`principals[${index}]: a token or its token_sha256, not both`);
    }
    if (token !== undefined && !(typeof token === 'string' && token.length >= 16)) {
      throw new TypeError(`principals[${index}].token must be at least 16 characters`);
    }
    if (digest !== undefined && !(typeof digest === 'string' && /^[0-9a-fA-F]{64}$/.test(digest))) {
      throw new TypeError(
        `principals[${index}].token_sha256 must be a SHA-256 digest: 64 hex digits`);
    }
    const known = digest !== undefined ? digest.toLowerCase()
      : token !== undefined ? crypto.createHash('sha256').update(token).digest('hex') : null;
    const principal = { name, agents: new Set(agents), admin: Boolean(item.admin) };
    if (known) byDigest.set(known, principal);
    byName.set(name, principal);
  });
  return { byDigest, byName };
}

/**
 * A credentials file an agent's server holds its callers to, as the broker does: a call needs
 * a bearer token the file names (UNAUTHENTICATED otherwise), and a message is sent only as an
 * agent its principal may act as (PERMISSION_DENIED otherwise; an admin may act as any: the
 * broker pushing, the gateway). Read again when it changes (looked at every
 * LOOK_MS): a token taken out is refused from then on; a file changed into what
 * cannot be used is said, and what was read before stays in use.
 */
class WatchedCredentials {
  constructor(path) {
    this.file = new WatchedFiles(`the credentials file ${path}`, [path],
      () => readCredentials(path));
    this.stop = this.file.listen(() => {}); // (looked at while the server lives)
  }

  /** The principal a bearer token names, or undefined. */
  byToken(token) {
    const digest = crypto.createHash('sha256').update(token).digest('hex');
    return this.file.current.byDigest.get(digest);
  }

  /** The principal of that name (a client certificate's), or undefined. */
  byName(name) {
    return this.file.current.byName.get(name);
  }
}

/** The names a call's verified client certificate carries: its subject's CN, then its DNS
 * names (none without one). */
function certificateNames(call) {
  const context = typeof call.getAuthContext === 'function' ? call.getAuthContext() : null;
  const peer = context && context.sslPeerCertificate;
  if (!peer || !peer.subject) return [];
  const names = [].concat(peer.subject.CN || []);
  for (const part of String(peer.subjectaltname || '').split(', ')) {
    if (part.startsWith('DNS:')) names.push(part.slice(4));
  }
  return names;
}

/**
 * How an agent's server holds its callers, as a Python agent's does: not at all without a
 * credentials file or mutual TLS. With them, a call needs a bearer token the file names or,
 * with mutual TLS, a client certificate (named as a principal of the file, or acting as the
 * agent its name is); UNAUTHENTICATED otherwise. A message is sent only as an agent that
 * principal may act as (an admin as any: the broker pushing, the gateway); PERMISSION_DENIED
 * otherwise. check(call, agentId, what) answers the gRPC error refusing the call, or null;
 * agentId undefined: the call acts as no agent.
 */
function callerCheck(credentials, mutual) {
  if (!credentials && !mutual) return () => null;
  const refuse = (code, details) => ({ code, details });
  return (call, agentId, what) => {
    const [header] = call.metadata.get('authorization');
    const bearer = /^Bearer\s+(.+)$/i.exec(String(header || '').trim());
    let principal;
    if (bearer) {
      principal = credentials && credentials.byToken(bearer[1].trim());
      if (!principal) return refuse(grpc.status.UNAUTHENTICATED, 'the token is not valid');
    } else if (mutual) {
      const names = certificateNames(call);
      principal = names.map((n) => credentials && credentials.byName(n)).find(Boolean)
        || (names.length ? { name: names[0], agents: new Set([names[0]]), admin: false } : null);
    }
    if (!principal) {
      return refuse(grpc.status.UNAUTHENTICATED, 'credentials required: a bearer token in the '
        + `authorization metadata${mutual ? ' or a client certificate' : ''}`);
    }
    if (agentId === undefined || principal.admin || principal.agents.has(agentId)) return null;
    return refuse(grpc.status.PERMISSION_DENIED,
      `${principal.name} may not ${what} as ${agentId || '(no agent)'}`);
  };
}

/** What a call on a closed client gets: said plainly, a MeshError like every other. */
function closedClient() {
  return new MeshError({ code: grpc.status.CANCELLED, reason: 'SESSION_CLOSED',
    details: 'this client is closed: make a new one (or keep it open while it is used)' });
}

/** Whether a client's channel was closed (close() on it, or on the client sharing it). */
function isClosed(client) {
  return client.getChannel().getConnectivityState(false) === grpc.connectivityState.SHUTDOWN;
}

/**
 * A wait the caller gives, in milliseconds: a finite number, not negative. Anything else is
 * the caller's mistake, a TypeError before anything is sent (a NaN sent a request and gave
 * it up at once).
 */
function checkWait(timeoutMs, field = 'timeoutMs') {
  if (!(typeof timeoutMs === 'number' && timeoutMs >= 0 && Number.isFinite(timeoutMs))) {
    throw new TypeError(
      `${field} must be a finite number of milliseconds, not negative (got ${timeoutMs})`);
  }
  return timeoutMs;
}

/**
 * What a subscription is given, checked before it opens (the broker's refusal of a frame
 * would end it with nobody told): a lease (leaseMs, when given) and a wait for company
 * (ackLingerMs) in finite milliseconds, a longest extension that is not negative (Infinity:
 * as long as a handler runs), windows (maxInFlight, maxBatch) in whole numbers.
 */
function checkSubscription({ leaseMs, ackLingerMs = 0, maxLeaseExtensionMs = 0, maxInFlight = 0,
  maxBatch = 0 }) {
  if (leaseMs !== undefined) checkWait(leaseMs, 'leaseMs');
  checkWait(ackLingerMs, 'ackLingerMs');
  if (!(typeof maxLeaseExtensionMs === 'number' && maxLeaseExtensionMs >= 0)) {
    throw new TypeError(
      `maxLeaseExtensionMs must be a number of milliseconds, not negative (got ${maxLeaseExtensionMs})`);
  }
  for (const [field, value] of [['maxInFlight', maxInFlight], ['maxBatch', maxBatch]]) {
    if (!(Number.isInteger(value) && value >= 0)) {
      throw new TypeError(`${field} must be a whole number, not negative (got ${value})`);
    }
  }
}

function unary(client, method, request, timeoutMs = 10000, metadata = client.meshMetadata) {
  if (isClosed(client)) return Promise.reject(closedClient());
  try {
    checkWait(timeoutMs);
  } catch (err) {
    return Promise.reject(err);
  }
  return new Promise((resolve, reject) => {
    client[method](request, metadata || new grpc.Metadata(),
      { deadline: Date.now() + timeoutMs }, (err, res) => {
        if (err) reject(new MeshError(err));
        else resolve(res);
      });
  });
}

/**
 * Every item of a paged listing (ListAgents, ListDeadLetters, ReadInsights): the server answers
 * up to 3 MiB at a time with a next_page_token while more follow.
 */
async function allPages(client, method, request, field) {
  const items = [];
  for (let pageToken = ''; ;) {
    const res = await unary(client, method, { ...request, page_token: pageToken });
    for (const item of res[field]) items.push(item);
    pageToken = res.next_page_token;
    if (!pageToken) return items;
  }
}

// -- the broker client ------------------------------------------------------------------------

/** RT-011 retry_backoff_ms: the waits before the retries of a call refused for a moment. */
const RETRY_DELAYS_MS = [100, 500, 2000];
// RT-011's deliveries of a message (max_retries = 3, a broker's default): after the last, one
// whose handler failed goes to the dead-letter queue without waiting out a backoff. A broker
// says its own with each delivery (max_delivery_attempts); this is for one that does not.
const DELIVERY_ATTEMPTS = 4;
/** What is worth trying again: a full queue (backpressure) and a broker out of reach. */
const RETRY_ON = ['RESOURCE_EXHAUSTED', 'UNAVAILABLE'];
/** The gateway's refusal of a run before it started (it runs its limit): safe to retry. */
const TOO_MANY_RUNS = 'TOO_MANY_RUNS';
/** The longest wait a refusal's google.rpc.RetryInfo is heeded for. */
const MAX_RETRY_DELAY_MS = 60000;

/**
 * Runs operation, and again after each of the client's retryDelaysMs while it fails with a
 * MeshError that refusedForNow says is worth another try: after the backoff, or the longer
 * wait the refusal asks for (its RetryInfo), up to a minute. The client's onRetry hears of
 * each retry first, and its stats.retries (when it keeps them) count them by code.
 */
async function retrying(client, operation, refusedForNow) {
  for (let attempt = 0; ; attempt += 1) {
    try {
      return await operation();
    } catch (err) {
      const backoffMs = client.retryDelaysMs[attempt];
      if (!(err instanceof MeshError) || !refusedForNow(err) || backoffMs === undefined) throw err;
      const delayMs = err.retryAfterMs == null ? backoffMs
        : Math.max(backoffMs, Math.min(err.retryAfterMs, MAX_RETRY_DELAY_MS));
      if (client.stats) {
        client.stats.retries[err.codeName] = (client.stats.retries[err.codeName] || 0) + 1;
      }
      if (client.onRetry) {
        client.onRetry({ attempt: attempt + 1, code: err.codeName, delayMs, error: err });
      }
      await new Promise((resolve) => { setTimeout(resolve, delayMs); });
    }
  }
}

/** A refusal for now: a full queue (backpressure), a server out of reach or stopping. */
const refusedForNow = (err) => RETRY_ON.includes(err.codeName);

class MeshClient {
  /**
   * A client of the broker at address, as agentId. A call refused with RESOURCE_EXHAUSTED or
   * UNAVAILABLE is tried again after each of retryDelaysMs (RT-011: 100, 500 and 2000 ms;
   * [] for none), the same message each time (the broker takes a message id once); retries
   * are counted in stats.retries by code, and onRetry({attempt, code, delayMs, error}) hears
   * of each.
   */
  constructor(address, { agentId = '', retryDelaysMs = RETRY_DELAYS_MS, onRetry = undefined,
    ...options } = {}) {
    this.agentId = agentId;
    this.retryDelaysMs = retryDelaysMs;
    this.onRetry = onRetry;
    this.stats = { retries: {} };
    const { credentials, metadata, channelOptions, stop } = security(options);
    this._stopLooking = stop;
    this.broker = new meshV1.BrokerService(checkTarget(address), credentials, channelOptions);
    this.broker.meshMetadata = metadata;
    // The shared state is served beside the broker, on the same channel.
    this.memory = new meshV1.MemoryService(address, credentials,
      { ...channelOptions, channelOverride: this.broker.getChannel() });
    this.memory.meshMetadata = metadata;
    // Tools too (under each agent's allow-list).
    this.tools = new meshV1.ToolService(address, credentials,
      { ...channelOptions, channelOverride: this.broker.getChannel() });
    this.tools.meshMetadata = metadata;
  }

  close() {
    if (this._session) this._session.call.cancel();
    this._stopLooking();
    this.broker.close();
  }

  /**
   * Runs operation, trying again after each of retryDelaysMs while it fails for a moment (or
   * after the longer wait the refusal asks for, its RetryInfo, up to a minute).
   */
  _withRetry(operation) {
    return retrying(this, operation, refusedForNow);
  }

  /**
   * The client's Connect session, opened on first use: sends and requests travel on it as
   * frames (a message on an open stream costs far less than a unary call), each answered by
   * the frame of the same seq. A session that fails fails what waits on it, and the next call
   * opens another.
   */
  _connect() {
    if (this._session && !this._session.closed) return this._session;
    if (isClosed(this.broker)) throw closedClient();
    // With agentmesh-batch the broker writes the answers ready at one moment as one batch frame.
    const metadata = (this.broker.meshMetadata || new grpc.Metadata()).clone();
    metadata.set('agentmesh-batch', '1');
    const call = this.broker.Connect(metadata);
    const session = { call, pending: new Map(), seq: 0, closed: false };
    // The frames of one moment (the sends of a Promise.all, the next sends of those answered
    // together) go out together too. One that cannot be written fails its own call alone.
    session.write = frameWriter(call, (frame, err) => {
      const waiting = session.pending.get(Number(frame.seq));
      if (!waiting) return;
      session.pending.delete(Number(frame.seq));
      waiting.reject(err);
    }).write;
    const fail = (err) => {
      if (session.closed) return;
      session.closed = true;
      for (const waiting of session.pending.values()) waiting.reject(err);
      session.pending.clear();
      if (this._session === session) this._session = null;
    };
    const answer = (frame) => {
      const waiting = session.pending.get(Number(frame.seq));
      if (!waiting) return;
      session.pending.delete(Number(frame.seq));
      if (frame.frame === 'error') {
        waiting.reject(errorFrom(frame.error));
      } else {
        waiting.resolve(frame);
      }
    };
    call.on('data', (frame) => {
      if (frame.frame === 'batch') frame.batch.frames.forEach(answer);
      else answer(frame);
    });
    call.on('error', (err) => fail(new MeshError(err)));
    call.on('end', () => fail(new MeshError({ code: grpc.status.UNAVAILABLE,
      details: 'the broker ended the session' })));
    this._session = session;
    return session;
  }

  /**
   * Writes a frame on the session; resolves with its answer (rejects with an error frame).
   * A cancellable frame (a request) is given up at the broker when the client stops waiting:
   * past timeoutMs, or when signal aborts (rejecting with the signal's reason).
   */
  _ask(frame, timeoutMs, { cancellable = false, signal } = {}) {
    if (signal?.aborted) return Promise.reject(signal.reason);
    const session = this._connect();
    session.seq += 1;
    const seq = session.seq;
    return new Promise((resolve, reject) => {
      const giveUp = (err) => {
        if (!session.pending.delete(seq)) return;
        clearTimeout(timer);
        signal?.removeEventListener('abort', onAbort);
        if (cancellable && !session.closed) session.write({ cancel: { seq } });
        reject(err);
      };
      const timer = setTimeout(() => giveUp(new MeshError({ code: grpc.status.DEADLINE_EXCEEDED,
        details: `the broker did not answer within ${timeoutMs} ms` })), timeoutMs);
      const onAbort = () => giveUp(signal.reason);
      signal?.addEventListener('abort', onAbort, { once: true });
      const settled = () => { clearTimeout(timer); signal?.removeEventListener('abort', onAbort); };
      session.pending.set(seq, {
        resolve: (answer) => { settled(); resolve(answer); },
        reject: (err) => { settled(); reject(err); },
      });
      session.write({ seq, ...frame });
    });
  }

  /**
   * Registers an agent (or one more instance of it, at address). With deliveryMode 'PUSH' the
   * broker calls HandleMessage on the server at address with each message queued for the
   * agent (any gRPC server of the Agent service); by default ('PULL') the agent takes them.
   * requiredFields: content keys every REQUEST and HANDOFF sent to the agent must carry
   * (e.g. ['action', 'parameters']); the broker refuses one that lacks any (INVALID_ARGUMENT).
   * A string alone is the agent id: register('PaymentAgent'), as deregister takes it.
   */
  async register(registration = {}) {
    if (typeof registration === 'string') return this.register({ agentId: registration });
    if (typeof registration !== 'object' || registration === null) {
      throw new TypeError(`register takes an agent id or {agentId, agentTypes, ...}, not ${
        JSON.stringify(registration)}`);
    }
    const { agentId = this.agentId, agentTypes = [], address = '', capabilities = [],
      deliveryMode = 'PULL', maxInFlight = 0, requiredFields = [] } = registration;
    if (!DELIVERY_MODES.includes(deliveryMode)) {
      throw new TypeError(`deliveryMode ${JSON.stringify(deliveryMode)} is not one of `
        + DELIVERY_MODES.join(', '));
    }
    if (!Number.isInteger(maxInFlight) || maxInFlight < 0) {
      throw new TypeError(`maxInFlight must be a whole number, not negative: ${maxInFlight}`);
    }
    if (!Array.isArray(requiredFields) || requiredFields.some((f) => typeof f !== 'string')) {
      throw new TypeError(
        `requiredFields is a list of content keys: ${JSON.stringify(requiredFields)}`);
    }
    const res = await this._withRetry(() => unary(this.broker, 'RegisterAgent', {
      agent: { agent_id: agentId, agent_types: namesOf(agentTypes, 'agentTypes'), address,
        capabilities: namesOf(capabilities, 'capabilities'), delivery_mode: `DELIVERY_MODE_${deliveryMode}`, max_in_flight: maxInFlight,
        required_fields: requiredFields },
    }));
    return readAgent(res.agent);
  }

  /**
   * Takes the agent off the mesh; with address, only the instance serving there leaves (the
   * agent stays while other processes serve it).
   */
  async deregister(agentId = this.agentId, { address = '' } = {}) {
    await this._withRetry(() => unary(this.broker, 'DeregisterAgent',
      { agent_id: agentId, address }));
  }

  /** Every registered agent (of agentType, when given), by id, page by page. */
  async listAgents(agentType = '') {
    const agents = await allPages(this.broker, 'ListAgents', { agent_type: agentType }, 'agents');
    return agents.map(readAgent);
  }

  /** Sends a message (on the session); returns it as accepted (with its id and recipients). */
  async send(to, content, options = {}) {
    const message = buildMessage({ from: this.agentId, to, content, ...options });
    const { accepted } = await this._withRetry(() => this._ask({ send: message }, 10000));
    return { ...readMessage(message), messageId: accepted.message_id,
      recipients: accepted.recipients };
  }

  /**
   * Hands a task to another agent with everything gathered so far (RT-011 hand-off): a
   * HANDOFF message whose content carries the task, the context (handed over complete), the
   * previous result and the constraints, and whose metadata names the workflow and step.
   * The next agent reads them as message.handoff. Resolves with the message as enqueued; a
   * hand-off without a task, or with a context over the broker's limit, is refused with
   * INVALID_ARGUMENT.
   */
  async handoff(to, taskDescription, { context = {}, previousResult = null, constraints = {},
    workflowId = '', stepNumber = 1, priority = 'MEDIUM', ttl = 0, headers = {},
    from = this.agentId } = {}) {
    if (!PRIORITIES.includes(priority)) {
      throw new TypeError(
        `priority ${JSON.stringify(priority)} is not one of ${PRIORITIES.join(', ')}`);
    }
    const res = await this._withRetry(() => unary(this.broker, 'Handoff', {
      from_agent: from,
      to_agent: to,
      handoff: {
        task_description: taskDescription,
        context: toStruct(context, 'context'),
        previous_result: toValue(previousResult),
        constraints: toStruct(constraints, 'constraints'),
        workflow_id: workflowId,
        step_number: stepNumber,
      },
      priority: `PRIORITY_${priority}`,
      ttl,
      headers,
    }));
    return readMessage(res.message);
  }

  /**
   * Adds a workflow's ending to the status its hand-offs keep in the shared state
   * (workflow/<workflowId>): status 'COMPLETED', or 'FAILED' with failedAtStep (by default the
   * step the status is at) and errorReason (RF-010 scenario 10), and finished_at; the status
   * keeps the time it has left. What the last agent of a workflow run by its agents alone
   * does (the gateway does it for the workflows it runs). Resolves with the status written,
   * or null, nothing written, when none is recorded (no hand-off named the workflow).
   */
  async endWorkflow(workflowId, { status = 'COMPLETED', failedAtStep, errorReason = '',
    agentId = this.agentId } = {}) {
    if (typeof workflowId !== 'string' || !workflowId) {
      throw new TypeError('workflowId is required');
    }
    if (status !== 'COMPLETED' && status !== 'FAILED') {
      throw new TypeError(`a workflow ends COMPLETED or FAILED, not ${JSON.stringify(status)}`);
    }
    const key = `workflow/${workflowId}`;
    // A compare-and-set on the version read, as the hand-offs write it: tried again when
    // another write came first.
    for (let tries = 0; tries < 3; tries += 1) {
      const current = await this.getState(key);
      if (current === null) return null;
      const now = new Date();
      const recorded = current.value !== null && typeof current.value === 'object'
        && !Array.isArray(current.value) ? current.value : {};
      const value = { ...recorded, status, finished_at: now.toISOString() };
      if (status === 'FAILED') {
        const step = Number.isInteger(recorded.step) ? recorded.step : 0;
        value.failed_at_step = failedAtStep ?? step;
        value.error_reason = errorReason;
      } else { // (over an ending written before: its failure is no longer the workflow's)
        delete value.failed_at_step;
        delete value.error_reason;
      }
      const ttlMs = current.expiresAt
        ? Math.max(1000, Date.parse(current.expiresAt) - now.getTime()) : undefined;
      try {
        return await this.putState(key, value,
          { expectedVersion: current.version, ttlMs, agentId });
      } catch (err) {
        if (err.reason !== 'VERSION_CONFLICT') throw err;
      }
    }
    throw new MeshError({ code: grpc.status.ABORTED, details: `'${key}' kept changing`,
      reason: 'VERSION_CONFLICT' });
  }

  /** Removes and returns the agent's queued messages (HIGH first, then oldest first): up to
   * maxMessages (0: all) and 3 MiB an answer, the rest waiting for the next call. */
  async receive(agentId = this.agentId, maxMessages = 0) {
    const res = await unary(this.broker, 'ReceiveMessages',
      { agent_id: agentId, max_messages: maxMessages });
    return res.messages.map(readMessage);
  }

  /**
   * Sends a REQUEST (on the session) and waits for the correlated RESPONSE, at most timeoutMs
   * (then DEADLINE_EXCEEDED, and the broker forgets the request). When signal (an AbortSignal)
   * aborts, the request is given up at once and rejects with the signal's reason: a handler
   * that passes on its own signal gives up what it asked when its requester gives up.
   */
  async request(to, content, { timeoutMs = 10000, signal, ...options } = {}) {
    checkWait(timeoutMs);
    const message = buildMessage({ from: this.agentId, to, content, ...options });
    const deadline = Date.now() + timeoutMs;
    // Tried again while refused for a moment, within the one timeout. The broker answers
    // DEADLINE_EXCEEDED at the deadline; the client gives up a moment later.
    const { response } = await this._withRetry(() => {
      const remaining = deadline - Date.now();
      if (remaining <= 0) {
        throw new MeshError({ code: grpc.status.DEADLINE_EXCEEDED,
          details: `no response from ${to} within ${timeoutMs} ms` });
      }
      return this._ask({ request: { message, timeout: toDuration(remaining) } }, remaining + 1000,
        { cancellable: true, signal });
    });
    return readMessage(response);
  }

  /**
   * Sends several messages in one call (the SendMessages RPC). Each is enqueued in order and
   * refused on its own (the others go in): resolves with one result per message, in order,
   * {messageId} when accepted, {messageId, error} (a MeshError with its reason) when refused.
   * Each message is a plain object as for send: {to, content, priority, ttl, type, ...}.
   */
  async sendBatch(messages, { timeoutMs = 10000 } = {}) {
    const built = messages.map((m) => buildMessage({ from: this.agentId, ...m }));
    const res = await this._withRetry(
      () => unary(this.broker, 'SendMessages', { messages: built }, timeoutMs));
    return res.results.map((r) => (r.error
      ? { messageId: r.message_id, error: errorFrom(r.error) }
      : { messageId: r.message_id }));
  }

  /**
   * Queue depths and counters (GetQueueStats), of one agent's queue or of all: {agents:
   * [{agentId, depth, high, medium, low, inFlight, deferred, deadLetters, subscribers}],
   * totals: the broker-wide counters of BrokerTotals, camelCased: held, sentCount, ...}.
   */
  async queueStats(agentId = '') {
    const res = await unary(this.broker, 'GetQueueStats', { agent_id: agentId });
    return { agents: res.agents.map(camelKeys), totals: camelKeys(res.totals) };
  }

  /**
   * Runs a tool through the mesh as this agent (the mesh enforces the agent's allow-list):
   * resolves with the tool's result. Refusals are MeshErrors with their reason:
   * TOOL_NOT_ALLOWED, UNKNOWN_TOOL, TOOL_TIMEOUT (worth retrying), TOOL_FAILED (not).
   */
  async callTool(tool, args = {}, { timeoutMs = 10000, agentId = this.agentId } = {}) {
    checkWait(timeoutMs);
    const res = await unary(this.tools, 'InvokeTool', { agent_id: agentId, tool,
      arguments: toStruct(args, 'arguments'), timeout: toDuration(timeoutMs) }, timeoutMs + 5000);
    return fromValue(res.result);
  }

  /** The tools an agent may use ([{name, description}]); every tool with agentId ''. */
  async listTools(agentId = this.agentId) {
    const res = await unary(this.tools, 'ListTools', { agent_id: agentId });
    return res.tools.map((t) => ({ name: t.name, description: t.description }));
  }

  /**
   * The dead-letter queue (oldest first), page by page: {message, reason, attempts,
   * deadLetteredAt}.
   */
  async deadLetters(agentId = '') {
    const letters = await allPages(this.broker, 'ListDeadLetters', { agent_id: agentId },
      'dead_letters');
    return letters.map((d) => ({ message: readMessage(d.message), reason: d.reason,
      attempts: d.delivery_attempts, deadLetteredAt: isoTime(d.dead_lettered_at) }));
  }

  /**
   * What agentId's queue holds (this client's agent by default), page by page, left where
   * it is: the messages waiting, in the order they will be delivered, then those in flight
   * or deferred, by when their lease or delay ends: {message, state ('WAITING', 'IN_FLIGHT'
   * or 'DEFERRED'), attempts, acceptedAt, expiresAt, until (null while waiting)}. As the
   * Python SDK's list_messages (ListMessages).
   */
  async listMessages(agentId = this.agentId) {
    const listed = await allPages(this.broker, 'ListMessages', { agent_id: agentId },
      'messages');
    return listed.map((q) => ({ message: readMessage(q.message),
      state: String(q.state).replace(/^QUEUED_STATE_/, ''), attempts: q.delivery_attempts,
      acceptedAt: isoTime(q.accepted_at), expiresAt: isoTime(q.expires_at),
      until: q.until ? isoTime(q.until) : null }));
  }

  /**
   * Puts agentId's dead letters (all, or those of messageIds) back in its queue once what
   * failed them is fixed, oldest first, each for a new round of delivery attempts; resolves
   * with {requeued, left} (left: those a full queue could not take, still dead letters).
   */
  /**
   * Takes back messages this client's agent (or from) sent to `to` that are not delivered
   * yet: waiting, or scheduled for later (delayMs, deliverAt). messages are their ids, or the
   * messages as send resolved them. Resolves with the ids taken back; one in flight, another
   * sender's, or one no longer held stays as it is.
   */
  async cancelMessages(to, messages, { from = this.agentId } = {}) {
    if (!Array.isArray(messages)) namesOf(messages, 'messages'); // (says what is wrong)
    const ids = namesOf(messages.map((m) => (m && typeof m === 'object' ? m.messageId : m)),
      'messages');
    const res = await this._withRetry(() => unary(this.broker, 'CancelMessages',
      { from_agent: from, to_agent: to, message_ids: ids }));
    return res.message_ids;
  }

  async requeueDeadLetters(agentId, messageIds = []) {
    const res = await this._withRetry(() => unary(this.broker, 'RequeueDeadLetters',
      { agent_id: agentId, message_ids: namesOf(messageIds, 'messageIds') }));
    return { requeued: res.requeued, left: res.left };
  }

  /**
   * Asks several agents at once (the Gather RPC): resolves with each agent's outcome,
   * {agentId, response, error}, in the order they came (agents that did not answer in time
   * last, with error.reason DEADLINE_EXCEEDED or TIMEOUT). When signal aborts, the gather is
   * given up (the broker withdraws the copies not answered) and rejects with its reason.
   */
  gather(content, { agentIds = [], agentTypes = [], timeoutMs = 5000, type = 'BROADCAST',
    allOrNone = false, signal, ...options } = {}) {
    if (signal?.aborted) return Promise.reject(signal.reason);
    try {
      checkWait(timeoutMs);
      namesOf(agentIds, 'agentIds');
      namesOf(agentTypes, 'agentTypes');
    } catch (err) {
      return Promise.reject(err);
    }
    const message = buildMessage({ from: this.agentId, to: 'broadcast', type, content,
      ...options });
    const call = this.broker.Gather(
      { message, agent_ids: agentIds, agent_types: agentTypes, timeout: toDuration(timeoutMs),
        all_or_none: allOrNone },
      this.broker.meshMetadata || new grpc.Metadata(),
      { deadline: Date.now() + timeoutMs + 5000 },
    );
    return new Promise((resolve, reject) => {
      const onAbort = () => { reject(signal.reason); call.cancel(); };
      signal?.addEventListener('abort', onAbort, { once: true });
      call.on('status', () => signal?.removeEventListener('abort', onAbort));
      const outcomes = [];
      call.on('data', (r) => outcomes.push({
        agentId: r.agent_id,
        response: r.response ? readMessage(r.response) : null,
        error: r.error ? { code: r.error.code, reason: r.error.reason, message: r.error.message }
          : null,
      }));
      call.on('error', (err) => reject(new MeshError(err)));
      call.on('end', () => resolve(outcomes));
    });
  }

  /**
   * Peer-to-peer negotiation (RT-011), as the Python SDK's negotiate: each round asks every
   * peer at once (a REQUEST with action "negotiate" and parameters negotiation_id, topic,
   * round, proposal); peers answer {decision: "accept" | "reject" | "counter", proposal,
   * reason}. Resolves with {status: AGREED | REJECTED | NO_AGREEMENT | TIMED_OUT, proposal,
   * rounds, negotiationId}. At most 3 rounds, 5 s and 10 peers; revise(terms, counters)
   * makes the next round's terms (by default the counters' terms are taken over).
   */
  async negotiate(peers, proposal, { topic = '', rounds = 3, timeoutMs = 5000,
    revise = adoptCounters } = {}) {
    namesOf(peers, 'peers');
    const problems = [];
    if (!peers.length || peers.length > 10 || new Set(peers).size !== peers.length
      || peers.includes(this.agentId)) {
      problems.push('peers: 1 to 10 distinct agents other than the proposer');
    }
    if (!(rounds >= 1 && rounds <= 3)) problems.push('rounds: within 1 and 3');
    if (!(timeoutMs > 0 && timeoutMs <= 5000)) problems.push('timeoutMs: above 0, at most 5000');
    if (problems.length) {
      throw new MeshError({ code: grpc.status.INVALID_ARGUMENT, details: problems.join('; ') });
    }
    const negotiationId = crypto.randomUUID();
    const deadline = Date.now() + timeoutMs;
    const history = [];
    let terms = { ...proposal };
    for (let round = 1; round <= rounds; round += 1) {
      const outcomes = await this.gather(
        { action: 'negotiate',
          parameters: { negotiation_id: negotiationId, topic, round, proposal: terms } },
        { agentIds: peers, timeoutMs: Math.max(deadline - Date.now(), 1), type: 'REQUEST',
          allOrNone: true, // a peer that is not registered: nobody is asked
          metadata: { negotiation_id: negotiationId, round } },
      );
      const replies = new Map();
      const missing = [];
      for (const { agentId, response, error } of outcomes) {
        if (response) {
          replies.set(agentId, response.type === 'ERROR'
            ? { peer: agentId, decision: 'reject', reason: String(response.content.error || '') }
            : readReply(agentId, response.content));
        } else if (error.code === grpc.status.DEADLINE_EXCEEDED) {
          missing.push(agentId);
        } else if (error.code === grpc.status.NOT_FOUND) {
          throw new MeshError({ code: error.code, details: error.message });
        } else {
          replies.set(agentId, { peer: agentId, decision: 'reject', reason: error.message });
        }
      }
      const ordered = peers.filter((p) => replies.has(p)).map((p) => replies.get(p));
      history.push({ round, proposal: terms, replies: ordered, missing });
      let status = null;
      if (missing.length) status = 'TIMED_OUT';
      else if (ordered.some((r) => r.decision === 'reject')) status = 'REJECTED';
      else if (!ordered.some((r) => r.decision === 'counter')) status = 'AGREED';
      else if (round === rounds) status = 'NO_AGREEMENT';
      if (status) return { status, proposal: terms, rounds: history, negotiationId };
      terms = revise(terms, ordered.filter((r) => r.decision === 'counter'));
    }
    throw new Error('unreachable');
  }

  // -- the shared memory pool -------------------------------------------------------------

  /**
   * Writes an insight (content: any JSON value); with ttlMs the pool keeps it that long,
   * else until it is deleted. Resolves with it as stored: {insightId, createdAt, expiresAt, ...}.
   */
  async writeInsight(content, { tags = [], importance = 0.5, segment = 'default', metadata = {},
    agentId = this.agentId, ttlMs = 0 } = {}) {
    checkWait(ttlMs, 'ttlMs');
    const insight = { agent_id: agentId, content: toValue(content), tags: namesOf(tags, 'tags'),
      importance, segment, metadata: toStruct(metadata, 'metadata') };
    if (ttlMs) insight.ttl = toDuration(ttlMs);
    return readInsight((await unary(this.memory, 'WriteInsight', { insight })).insight);
  }

  /** Insights with all of tags (and of segment, agentId), most important first, then newest. */
  async readInsights({ tags = [], segment = '', minImportance = 0, limit = 0,
    agentId = '' } = {}) {
    const insights = await allPages(this.memory, 'ReadInsights', { tags: namesOf(tags, 'tags'),
      segment,
      min_importance: minImportance, limit, agent_id: agentId }, 'insights');
    return insights.map(readInsight);
  }

  /** Removes the insights matching every filter given (at least one); resolves with how many. */
  async deleteInsights({ insightIds = [], tags = [], segment = '', agentId = '' } = {}) {
    const res = await unary(this.memory, 'DeleteInsights', {
      insight_ids: namesOf(insightIds, 'insightIds'), tags: namesOf(tags, 'tags'), segment,
      agent_id: agentId });
    return res.deleted;
  }

  /** {totalInsights, agentsInvolved, tagDistribution, segmentDistribution, capacity}. */
  async memoryStats() {
    const res = await unary(this.memory, 'GetMemoryStats', {});
    return { totalInsights: res.total_insights, agentsInvolved: res.agents_involved,
      tagDistribution: res.tag_distribution, segmentDistribution: res.segment_distribution,
      capacity: res.capacity };
  }

  // -- shared state (RT-011 shared_state) --------------------------------------------------

  /**
   * The entry {key, value, version, updatedBy, updatedAt, expiresAt}, or null when there is
   * none (expiresAt: null for an entry that stays until deleted).
   */
  async getState(key) {
    try {
      return readEntry((await unary(this.memory, 'GetState', { key })).entry);
    } catch (err) {
      if (err.codeName === 'NOT_FOUND') return null;
      throw err;
    }
  }

  /**
   * One page of the entries whose keys start with prefix (every entry, without one), in key
   * order: resolves with {entries, nextPageToken}, nextPageToken '' after the last page.
   * pageSize: at most that many (100 by default, 1000 at most; fewer when the values are
   * large); pageToken: the previous page's nextPageToken.
   */
  async listState(prefix = '', { pageSize = 0, pageToken = '' } = {}) {
    const res = await unary(this.memory, 'ListState',
      { prefix, page_size: pageSize, page_token: pageToken });
    return { entries: (res.entries || []).map(readEntry), nextPageToken: res.next_page_token };
  }

  /**
   * Every entry whose key starts with prefix, in key order, a page read at a time:
   * `for await (const entry of client.stateEntries('workflow/'))`.
   */
  async* stateEntries(prefix = '') {
    let pageToken = '';
    do {
      const page = await this.listState(prefix, { pageToken });
      yield* page.entries;
      pageToken = page.nextPageToken;
    } while (pageToken);
  }

  /**
   * Each change to the entries whose keys start with prefix as it is made, in order:
   * `for await (const { kind, entry } of client.watchState('workflow/'))`. kind: 'put' (entry:
   * the new version), 'delete' or 'lapse' (its last version); with sendInitial the entries
   * there are come first ('current'), and 'synced' (entry null) says the watch is in place.
   * Leaving the loop ends the watch; one that fell 1000 changes behind ends with a MeshError
   * RESOURCE_EXHAUSTED (reason WATCH_BEHIND), one whose broker missed changes with
   * UNAVAILABLE: watch again with sendInitial to catch up.
   *
   * With resume it catches up by itself: a watch in place that ends because its broker went
   * away (restarted, shutting down, cut off from Redis) or because it fell behind is begun
   * again, with backoff, for up to reconnectTimeoutMs (60 s), and tells what changed
   * meanwhile ('put' of each entry written, its latest version; 'delete' of each one gone:
   * deleted, lapsed, or lost with the memory of a broker that restarted), then 'synced'
   * again. For that it keeps the entries under prefix.
   */
  async* watchState(prefix = '',
    { sendInitial = false, resume = false, reconnectTimeoutMs = 60000 } = {}) {
    if (!resume) {
      yield* this._watchState(prefix, sendInitial);
      return;
    }
    const known = new Map(); // key -> the entry as the watcher was last told of it
    let synced = false;
    let failure = null;
    let giveUp = 0;
    let attempt = 0;
    for (;;) {
      const caughtUp = failure ? [] : null; // (the entries now, while catching up)
      try {
        for await (const change of this._watchState(prefix, true)) {
          if (!failure) { // in place: as it comes
            if (change.kind === 'current' || change.kind === 'put') known.set(change.entry.key, change.entry);
            else if (change.entry) known.delete(change.entry.key);
            else synced = true;
            if (sendInitial || change.kind !== 'current') yield change;
          } else if (change.entry) {
            caughtUp.push(change.entry);
          } else { // synced: in place again
            yield* catchUp(known, caughtUp);
            failure = null;
            attempt = 0;
            yield change;
          }
        }
        return; // (ended without an error: closed)
      } catch (err) {
        if (!(err instanceof MeshError)
          || !(err.codeName === 'UNAVAILABLE' || err.reason === 'WATCH_BEHIND')) throw err;
        if (!failure) {
          if (!synced) throw err; // (never in place: nothing to resume)
          giveUp = Date.now() + reconnectTimeoutMs;
        } else if (Date.now() >= giveUp) {
          throw err;
        }
        failure = err;
      }
      await new Promise((resolve) => {
        setTimeout(resolve, RECONNECT_DELAYS_MS[Math.min(attempt, RECONNECT_DELAYS_MS.length - 1)]);
      });
      attempt += 1;
      if (isClosed(this.memory)) throw closedClient();
    }
  }

  async* _watchState(prefix, sendInitial) {
    if (isClosed(this.memory)) throw closedClient();
    const call = this.memory.WatchState({ prefix, send_initial: sendInitial },
      this.memory.meshMetadata || new grpc.Metadata());
    try {
      for await (const res of call) {
        const kind = String(res.kind).replace('STATE_CHANGE_KIND_', '').toLowerCase();
        if (!CHANGE_KINDS.has(kind)) continue; // (a kind of change a newer broker tells of)
        yield { kind, entry: res.entry ? readEntry(res.entry) : null };
      }
    } catch (err) {
      throw err instanceof MeshError ? err : new MeshError(err);
    } finally {
      call.cancel();
    }
  }

  /**
   * Writes a new version of key. expectedVersion (0: "none yet") makes it a compare-and-set
   * (ABORTED, reason VERSION_CONFLICT, when another write came first); lock is the writer's
   * lock from lockState when it holds one; ttlMs makes the entry lapse that long after this
   * write (it is then read as absent).
   */
  async putState(key, value, { expectedVersion, lock, ttlMs, agentId = this.agentId } = {}) {
    const request = { key, value: toValue(value), agent_id: agentId,
      lock_token: lock ? lock.token : '' };
    if (expectedVersion !== undefined) request.expected_version = expectedVersion;
    if (ttlMs !== undefined) {
      if (typeof ttlMs !== 'number' || !(ttlMs > 0)) {
        throw new TypeError(`ttlMs must be a number of milliseconds above 0, not ${ttlMs}`);
      }
      request.ttl = toDuration(ttlMs);
    }
    return readEntry((await unary(this.memory, 'PutState', request)).entry);
  }

  /** Removes key (under the rules of putState); resolves with its last version. */
  async deleteState(key, { expectedVersion, lock, agentId = this.agentId } = {}) {
    const request = { key, agent_id: agentId, lock_token: lock ? lock.token : '' };
    if (expectedVersion !== undefined) request.expected_version = expectedVersion;
    return readEntry((await unary(this.memory, 'DeleteState', request)).entry);
  }

  /**
   * Locks key for this agent, waiting at most waitMs (1000, the most); rejects with ABORTED
   * (reason LOCK_TIMEOUT) when another agent still holds it. Resolves with {key, token,
   * expiresAt}; the lock lapses after leaseMs (10 s by default) unless released.
   */
  async lockState(key, { waitMs, leaseMs, agentId = this.agentId } = {}) {
    const request = { key, agent_id: agentId };
    if (waitMs !== undefined) request.wait = toDuration(waitMs);
    if (leaseMs !== undefined) request.lease = toDuration(leaseMs);
    const res = await unary(this.memory, 'LockState', request);
    return { key, token: res.lock_token, expiresAt: isoTime(res.expires_at) };
  }

  async unlockState(lock) {
    await unary(this.memory, 'UnlockState', { key: lock.key, lock_token: lock.token });
  }

  /**
   * A copy to every other registered agent, or only to those of agentTypes (on the session):
   * resolves with {messageId, recipients, failures}.
   */
  async broadcast(content, { agentTypes = [], ...options } = {}) {
    const message = buildMessage({ from: this.agentId, to: 'broadcast', type: 'BROADCAST',
      content, ...options });
    const { broadcasted: res } = await this._ask(
      { broadcast: { message, agent_types: namesOf(agentTypes, 'agentTypes') } }, 10000);
    return {
      messageId: res.message_id,
      recipients: res.recipients,
      // Agents that could not take a copy (a full queue), each with the broker's error.
      failures: res.failures.map((f) => ({ agentId: f.agent_id,
        error: errorFrom(f.error) })),
    };
  }

  /**
   * An agent's deliveries on one Connect stream, the broker's fast path: whatever is ready
   * comes in one frame (up to maxBatch), and answers and acks go back as frames on the same
   * stream (the acks of a moment in one frame; in a steady flow an ack lingers up to
   * ackLingerMs, 2 by default, for company while less than half of maxInFlight is
   * outstanding). handle(message, attempt) resolves to the answer (a message built with
   * buildMessage, sent and taking the place of the ack when it answers this message) or to
   * null (acknowledged); when it throws, the message is handed back for redelivery (a
   * Reject sends it to the dead-letter queue at once, with the Reject's message). (A message
   * sent with ackRequired is acknowledged to its sender by the broker, with an ACK message as
   * it first hands it over.) A delivery stays leased leaseMs (30,000) unless acked; while
   * handle still works on one, its lease is extended every third of that, for up to
   * maxLeaseExtensionMs (an hour), so that a slow handler is not run twice. A request whose
   * requester gives up (cancels it, or its deadline passes) is withdrawn by the broker: the
   * third argument of handle, {signal}, is an AbortSignal that aborts then, so that the work
   * may stop; its outcome is neither sent nor acknowledged (the broker dropped it). The returned
   * stream emits 'subscribed' once the broker took the subscription, 'refused' (a
   * MeshError) when the broker refuses an answer it was sent, and 'error' / 'end'
   * when the session is over ('error' with reason AGENT_DEREGISTERED when the broker
   * ended the subscription: the agent was deregistered; the signal of each handling aborts
   * then, as what it held went back to the queue). instance: the address this agent's
   * process registered; the session then holds that instance among the agent's, and its
   * loss (the process dies) takes it off.
   */
  session(handle, { agentId = this.agentId, maxInFlight = 16, maxBatch = 16,
    ackLingerMs = 2, leaseMs: askedLeaseMs, maxLeaseExtensionMs = 3600000,
    instance = '' } = {}) {
    checkSubscription({ leaseMs: askedLeaseMs, ackLingerMs, maxLeaseExtensionMs, maxInFlight,
      maxBatch });
    const leaseMs = askedLeaseMs || 30000; // (0 too: a length the extensions know)
    const metadata = (this.broker.meshMetadata || new grpc.Metadata()).clone();
    metadata.set('agentmesh-batch', '1');
    if (isClosed(this.broker)) throw closedClient();
    const call = this.broker.Connect(metadata);
    // Answers and acks of one moment (the deliveries of a frame, handled at once) go out
    // together; one that cannot be written is said as a refusal.
    const writer = frameWriter(call, (frame, err) => call.emit('refused', new MeshError({
      code: grpc.status.INVALID_ARGUMENT, details: `a frame could not be written: ${err.message}` })));
    const { write } = writer;
    const inFlight = new Map(); // handling -> {id, started}
    const keeper = keepLeases(inFlight, leaseMs, maxLeaseExtensionMs, (ids) => write({
      extend_lease: { agent_id: agentId, message_ids: ids, lease: toDuration(leaseMs) } }));
    for (const over of ['status', 'error', 'close']) call.on(over, () => clearInterval(keeper));
    let closing = false;
    // Acks go together: those of a moment (a batch of deliveries handled together) in one
    // frame. In a steady flow (the ack before came less than half ackLingerMs ago), and while
    // less than half the window is outstanding, an ack waits up to ackLingerMs for company;
    // after a pause, or past half the window, it goes at once.
    let acks = [];
    let lingering = null;
    let lastAck = -Infinity;
    const flushAcks = () => {
      if (lingering) clearTimeout(lingering);
      lingering = null;
      if (acks.length === 0) return;
      write({ ack: { agent_id: agentId, message_ids: acks } });
      acks = [];
    };
    const pressed = () => 2 * (acks.length + inFlight.size) >= maxInFlight;
    const ack = (messageId) => {
      const now = performance.now();
      const steady = now - lastAck < ackLingerMs / 2;
      lastAck = now;
      if (acks.push(messageId) === 1) {
        if (steady && !closing && !pressed()) lingering = setTimeout(flushAcks, ackLingerMs);
        else setImmediate(flushAcks);
      } else if (lingering && pressed()) {
        flushAcks();
      }
    };
    const working = new Map(); // message id -> AbortController of its handling
    const settle = (delivery) => {
      const message = readMessage(delivery.message);
      // Come while closing: left alone; the unsubscribe hands it back as never delivered.
      if (closing) return;
      const aborting = new AbortController();
      const { signal } = aborting;
      working.set(message.messageId, aborting);
      const done = (async () => {
        try {
          const answer = await handle(message, delivery.delivery_attempt,
            handlerContext(delivery, signal));
          if (signal.aborted) return; // withdrawn: nobody waits, nothing to ack
          if (answer) write({ send: answer });
          if (!answers(answer, message)) ack(message.messageId);
        } catch (err) {
          if (signal.aborted) return;
          write({ nack: nackOf(agentId, message.messageId, err) });
        }
      })();
      inFlight.set(done, { id: message.messageId, started: performance.now() });
      done.finally(() => {
        inFlight.delete(done);
        if (working.get(message.messageId) === aborting) working.delete(message.messageId);
      });
    };
    const withdraw = (withdrawn) => {
      for (const id of withdrawn.message_ids) {
        const aborting = working.get(id);
        if (aborting) aborting.abort(withdrawnError());
        stopKeeping(inFlight, id);
      }
      call.emit('withdrawn', withdrawn.message_ids);
    };
    /**
     * Ends the session gracefully: the messages being handled are answered (for up to
     * graceMs), then the subscription ends: what is still being handled goes back to the
     * queue counting a delivery attempt, what came meanwhile goes back as never delivered.
     * The stream is half-closed so that the broker takes every answer in first.
     */
    call.close = async (graceMs = 5000) => {
      closing = true;
      const waited = (promise) => Promise.race([
        promise, new Promise((resolve) => { setTimeout(resolve, graceMs).unref(); })]);
      await waited(Promise.allSettled([...inFlight.keys()]));
      flushAcks();
      clearInterval(keeper);
      write({ seq: 2, unsubscribe: { agent_id: agentId, release_unseen: true,
        seen_message_ids: [...inFlight.values()].map((work) => work.id) } });
      const over = new Promise((resolve) => { call.on('status', resolve); call.on('error', resolve); });
      writer.flush();
      if (!call.writableEnded) call.end();
      await waited(over);
      call.cancel();
    };
    const take = (frame) => {
      switch (frame.frame) {
        case 'batch': frame.batch.frames.forEach(take); break;
        case 'delivery': settle(frame.delivery); break;
        case 'deliveries': frame.deliveries.deliveries.forEach(settle); break;
        case 'withdrawn': withdraw(frame.withdrawn); break;
        case 'ended':
          // The broker ended the subscription: the agent was deregistered (NOT_FOUND, reason
          // AGENT_DEREGISTERED). What it held went back to the queue; the session is over.
          closing = true;
          for (const aborting of working.values()) aborting.abort(errorFrom(frame.ended.error));
          call.emit('error', errorFrom(frame.ended.error));
          call.cancel();
          break;
        case 'accepted': if (Number(frame.seq) === 1) call.emit('subscribed'); break;
        case 'error':
          if (Number(frame.seq) === 1) {
            call.emit('error', errorFrom(frame.error));
            call.cancel();
          } else {
            // A frame sent without waiting (an answer, an ACK of receipt) that the broker
            // refused, e.g. to a sender no longer registered: said, not lost in silence.
            call.emit('refused', errorFrom(frame.error));
          }
          break;
        default: break;
      }
    };
    call.on('data', take);
    call.on('error', () => {}); // listeners of the caller's decide; none must not crash
    write({ seq: 1, subscribe: { agent_id: agentId, max_in_flight: maxInFlight,
      max_batch: maxBatch, lease: toDuration(leaseMs), withdrawals: true, instance } });
    return call;
  }

  /**
   * Deliveries of the agent's messages on the plain Subscribe stream (one per frame, acks as
   * unary calls; session() is the fast path): onDelivery(message, attempt, {signal}) must
   * resolve to ack. (A message sent with ackRequired is acknowledged to its sender by the
   * broker, as it hands it over.) Leases are kept while onDelivery runs, as
   * session() keeps them (ExtendLease calls); signal aborts when the broker withdraws the
   * message (its requester gave up), and it is then neither acked nor nacked.
   */
  subscribe(onDelivery, { agentId = this.agentId, maxInFlight = 16, leaseMs: askedLeaseMs,
    maxLeaseExtensionMs = 3600000, instance = '' } = {}) {
    checkSubscription({ leaseMs: askedLeaseMs, maxLeaseExtensionMs, maxInFlight });
    const leaseMs = askedLeaseMs || 30000; // (0 too: a length the extensions know)
    if (isClosed(this.broker)) throw closedClient();
    const call = this.broker.Subscribe({ agent_id: agentId, max_in_flight: maxInFlight,
      lease: toDuration(leaseMs), withdrawals: true, instance }, this.broker.meshMetadata);
    const working = new Map(); // message id -> AbortController of its handling
    const inFlight = new Map(); // handling -> {id, started}
    const keeper = keepLeases(inFlight, leaseMs, maxLeaseExtensionMs, (ids) => unary(
      this.broker, 'ExtendLease',
      { agent_id: agentId, message_ids: ids, lease: toDuration(leaseMs) }).catch(() => {}));
    for (const over of ['status', 'error', 'close']) call.on(over, () => clearInterval(keeper));
    call.on('data', async (res) => {
      if (!res.delivery) { // withdrawn deliveries
        for (const id of res.withdrawn.message_ids) {
          working.get(id)?.abort(withdrawnError());
          stopKeeping(inFlight, id);
        }
        call.emit('withdrawn', res.withdrawn.message_ids);
        return;
      }
      const message = readMessage(res.delivery.message);
      const work = { id: message.messageId, started: performance.now() };
      inFlight.set(work, work);
      const aborting = new AbortController();
      const { signal } = aborting;
      working.set(message.messageId, aborting);
      try {
        await onDelivery(message, res.delivery.delivery_attempt,
          handlerContext(res.delivery, signal));
        if (!signal.aborted) {
          await unary(this.broker, 'Ack', { agent_id: agentId, message_ids: [message.messageId] });
        }
      } catch (err) {
        if (!signal.aborted) {
          await unary(this.broker, 'Nack', nackOf(agentId, message.messageId, err))
            .catch(() => {});
        }
      } finally {
        inFlight.delete(work);
        if (working.get(message.messageId) === aborting) working.delete(message.messageId);
      }
    });
    call.on('error', () => {});
    return call;
  }
}

/** The context a handler of `delivery` is given (see HandlerContext). */
function handlerContext(delivery, signal) {
  return { signal, maxDeliveryAttempts: delivery.max_delivery_attempts || 0,
    attempt: delivery.delivery_attempt || 1 };
}

/**
 * Whether a frame sent in reply to a delivery takes the place of its ack: an answer (RESPONSE
 * or ERROR) to it. A request handed on to another agent (a forward) asks, it does not answer.
 */
function answers(reply, message) {
  return Boolean(reply)
    && (reply.message_type === 'MESSAGE_TYPE_RESPONSE' || reply.message_type === 'MESSAGE_TYPE_ERROR')
    && reply.correlation_id === message.messageId;
}

/** What a serveAgent handler returns to hand a REQUEST on (see forward in its context). */
class Forward {
  constructor(to, content) {
    this.to = to;
    this.content = content;
  }
}

/** The `forward` of a serveAgent handler's context, for the delivery `message`. */
function forwarding(message) {
  return (to, content) => {
    if (message.type !== 'REQUEST') {
      throw new TypeError(`only a REQUEST can be forwarded, not a ${message.type}: `
        + 'send or hand off a new message instead');
    }
    if (typeof to !== 'string' || !to || to === 'broadcast') {
      throw new TypeError(`forward needs the id of the agent to hand the request to, not ${
        JSON.stringify(to)}`);
    }
    return new Forward(to, content);
  };
}

/**
 * The REQUEST handed on: to the next agent, answering the requester (replyTo) under the
 * request's correlation id, with its priority, metadata and headers, expiring with it.
 */
function forwardOf(message, agentId, forward) {
  const built = buildMessage({ from: agentId, to: forward.to, type: 'REQUEST',
    content: forward.content === undefined ? message.content : forward.content,
    metadata: message.metadata, priority: message.priority, ttl: message.ttl,
    replyTo: message.replyTo || message.from,
    correlationId: message.correlationId || message.messageId, headers: message.headers });
  const sent = Date.parse(message.timestamp);
  if (message.ttl && !Number.isNaN(sent)) {
    built.timestamp = { seconds: Math.floor(sent / 1000), nanos: (sent % 1000) * 1e6 };
  }
  return built;
}

/** A withdrawn delivery's lease is no longer kept (nor waited for), whatever its handler does. */
function stopKeeping(inFlight, id) {
  for (const [key, work] of inFlight) if (work.id === id) inFlight.delete(key);
}

/** Why a withdrawn delivery's AbortSignal aborted. */
function withdrawnError() {
  return new MeshError({ code: grpc.status.CANCELLED, reason: 'WITHDRAWN',
    details: 'the request was withdrawn: its requester gave up (cancelled, or past its deadline)' });
}

/**
 * Every third of leaseMs, hands extend(ids) the ids of the deliveries still being handled
 * ({id, started} values of inFlight) for less than maxExtensionMs: their leases are extended
 * while they run. The timer does not keep the process alive; clear it when done.
 */
function keepLeases(inFlight, leaseMs, maxExtensionMs, extend) {
  const timer = setInterval(() => {
    const now = performance.now();
    const ids = [...inFlight.values()]
      .filter((work) => now - work.started <= maxExtensionMs).map((work) => work.id);
    if (ids.length) extend(ids);
  }, leaseMs / 3); // (0 asks for the broker's default, 30 s)
  timer.unref();
  return timer;
}

// -- requests from plain objects --------------------------------------------------------------

const camel = (name) => name.replace(/_([a-z])/g, (_, c) => c.toUpperCase());

/** A google.protobuf.Duration from milliseconds, "2s" / "1.5s" / "500ms", or {seconds, nanos}. */
/**
 * The address of a server for gRPC to dial as meant, else a TypeError that says why (as the
 * Python SDK says it): empty, a URL (what buf curl is given: gRPC reads it as a host name and
 * fails every call UNAVAILABLE), or a host:port whose port is past 65535.
 */
function checkTarget(address) {
  if (typeof address !== 'string' || !address.trim()) {
    throw new TypeError('an address is required: host:port (or any gRPC target)');
  }
  const url = /^(https?|grpcs?):\/\/(.*)$/i.exec(address);
  if (url) {
    throw new TypeError(`${address} is a URL, not a gRPC target: give host:port `
      + `(${url[2].replace(/\/+$/, '')}; TLS is set apart, not by ${url[1]}://)`);
  }
  if (!/^(dns|unix|unix-abstract|ipv4|ipv6|vsock):/.test(address) && !address.includes('://')) {
    const port = address.slice(address.lastIndexOf(':') + 1);
    if (/^[0-9]+$/.test(port) && !(Number(port) > 0 && Number(port) < 65536)) {
      throw new TypeError(`${address}: a port is from 1 to 65535`);
    }
  }
  return address;
}

/**
 * The names a caller lists (agent ids or types, capabilities, tags, message ids): an array of
 * strings. A bare string is a TypeError naming the field (the wire refused it as "array
 * expected", said as INTERNAL), as it is in the Python SDK.
 */
function namesOf(values, field) {
  if (typeof values === 'string') {
    throw new TypeError(`${field} is a list, not one string: write [${JSON.stringify(values)}]`);
  }
  if (!Array.isArray(values) || values.some((v) => typeof v !== 'string')) {
    throw new TypeError(`${field} is a list of strings, not ${JSON.stringify(values)}`);
  }
  return values;
}

function toDuration(v) {
  if (typeof v === 'number') {
    return { seconds: Math.floor(v / 1000), nanos: Math.round((v % 1000) * 1e6) };
  }
  if (typeof v === 'string') {
    const m = /^(\d+(?:\.\d+)?)(ms|s)$/.exec(v.trim());
    if (!m) throw new TypeError(`not a duration: ${JSON.stringify(v)} (use 2s, 1.5s or 500ms)`);
    return toDuration(m[2] === 'ms' ? Number(m[1]) : Number(m[1]) * 1000);
  }
  return v;
}

function resolveType(name, scope) {
  for (const candidate of [`${scope}.${name}`, `mesh.v1.${name}`, name]) {
    if (definition[candidate]) return candidate;
  }
  throw new TypeError(`unknown message type ${name}`);
}

function convertField(typeName, value, scope) {
  if (typeName === 'google.protobuf.Struct') return toStruct(value);
  if (typeName === 'google.protobuf.Value') return toValue(value);
  if (typeName === 'google.protobuf.Duration') return toDuration(value);
  return toRequest(resolveType(typeName, scope), value);
}

/**
 * A request of the given message type from a plain object whose keys are the proto field names
 * in snake_case or camelCase: Struct fields take plain objects, durations take milliseconds or
 * "2s", maps take objects. A key the message does not have is an error (a typo would otherwise
 * be dropped without a word).
 */
function toRequest(typeName, obj) {
  const { type } = definition[typeName];
  const out = {};
  const known = new Set();
  for (const field of type.field) {
    known.add(field.name).add(camel(field.name));
    const value = obj[field.name] !== undefined ? obj[field.name] : obj[camel(field.name)];
    if (value === undefined || value === null) continue;
    if (field.type !== 'TYPE_MESSAGE') {
      out[field.name] = value;
      continue;
    }
    const entry = type.nestedType.find((n) => n.name === field.typeName && n.options?.mapEntry);
    if (entry) {
      const valueField = entry.field.find((f) => f.name === 'value');
      out[field.name] = valueField.type !== 'TYPE_MESSAGE' ? value : Object.fromEntries(
        Object.entries(value).map(([k, v]) => [k, convertField(valueField.typeName, v, typeName)]));
    } else if (field.label === 'LABEL_REPEATED') {
      out[field.name] = value.map((v) => convertField(field.typeName, v, typeName));
    } else {
      out[field.name] = convertField(field.typeName, value, typeName);
    }
  }
  const unknown = Object.keys(obj).filter((k) => !known.has(k));
  if (unknown.length) {
    throw new TypeError(`${typeName} has no field ${unknown.join(', ')}`);
  }
  return out;
}

// -- the gateway client -----------------------------------------------------------------------

const patternName = (pattern) => String(pattern).replace('PATTERN_', '');

function readEvent(pb) {
  return {
    runId: pb.run_id,
    pattern: patternName(pb.pattern),
    kind: String(pb.kind).replace('EVENT_KIND_', ''),
    timestamp: isoTime(pb.timestamp),
    elapsedMs: pb.elapsed_ms,
    agentId: pb.agent_id,
    step: pb.step,
    round: pb.round,
    summary: pb.summary,
    data: fromStruct(pb.data),
  };
}

/** A plain object from a mesh.v1.PatternStats. */
function readPatternStats(pb) {
  return { ...camelKeys(pb), pattern: patternName(pb.pattern) };
}

class GatewayClient {
  /**
   * A client of the gateway at address. A run the gateway refuses before it starts, because it
   * already runs its limit (RESOURCE_EXHAUSTED, reason TOO_MANY_RUNS), is started again after
   * each of retryDelaysMs (RT-011: 100, 500 and 2000 ms, or the longer wait the refusal asks
   * for; [] for none), and onRetry({attempt, code, delayMs, error}) hears of each. Nothing else
   * of a run is tried again: a run that failed may have done part of its work. patternStats and
   * recordFeedback are made again after the same waits while refused for now
   * (RESOURCE_EXHAUSTED, UNAVAILABLE).
   */
  constructor(address, { retryDelaysMs = RETRY_DELAYS_MS, onRetry = undefined, ...options } = {}) {
    const { credentials, metadata, channelOptions, stop } = security(options);
    this._stopLooking = stop;
    this.gateway = new meshV1.GatewayService(checkTarget(address), credentials, channelOptions);
    this.metadata = metadata;
    this.retryDelaysMs = retryDelaysMs;
    this.onRetry = onRetry;
  }

  close() {
    this._stopLooking();
    this.gateway.close();
  }

  /**
   * Runs a pattern RPC (RunGroupChat, RunHandoffWorkflow, ...): the request is a plain object
   * with the proto's field names (snake_case or camelCase), plus timeoutMs (default 60 s);
   * calls onEvent for each streamed event and resolves with all of them, the RESULT last.
   */
  run(method, { timeoutMs = 60000, ...fields } = {}, onEvent = undefined) {
    let request;
    try {
      checkWait(timeoutMs);
      request = toRequest(`mesh.v1.${method}Request`, fields);
    } catch (err) {
      return Promise.reject(err);
    }
    if (isClosed(this.gateway)) return Promise.reject(closedClient());
    return this._runRetrying(method, request, timeoutMs, onEvent);
  }

  _runRetrying(method, request, timeoutMs, onEvent) {
    let events = [];
    return retrying(this, () => {
      events = [];
      return this._runOnce(method, request, timeoutMs, onEvent, events);
    }, (err) => !events.length && err.reason === TOO_MANY_RUNS);
  }

  _runOnce(method, request, timeoutMs, onEvent, events) {
    const call = this.gateway[method](request, this.metadata, { deadline: Date.now() + timeoutMs });
    return new Promise((resolve, reject) => {
      call.on('data', (res) => {
        const event = readEvent(res.event);
        events.push(event);
        if (onEvent) onEvent(event);
      });
      call.on('error', (err) => reject(new MeshError(err)));
      call.on('end', () => resolve(events));
    });
  }

  /** Group chat: {agentIds, query, rounds, optionLabel, agentTimeout, ...}. */
  groupChat(request, onEvent) { return this.run('RunGroupChat', request, onEvent); }

  /** Hand-off workflow: {steps: [{agentId, routes, ...}], task, context, failureAgent, ...}. */
  handoffWorkflow(request, onEvent) { return this.run('RunHandoffWorkflow', request, onEvent); }

  /** Collaborative filtering: {agentIds, weights, query, method, ...}. */
  collaborativeFiltering(request, onEvent) {
    return this.run('RunCollaborativeFiltering', request, onEvent);
  }

  /** The orchestrator picks the pattern for a request type: {requestType, query, parameters}. */
  route(request, onEvent) { return this.run('Route', request, onEvent); }

  /** Several patterns at once: {patterns: [{name, route: {...}} | {name, groupChat: {...}}]}. */
  parallel(request, onEvent) { return this.run('RunParallel', request, onEvent); }

  /** Consensus building: {problem, reviewerIds, threshold, quorum, waitForAllVotes, ...}. */
  consensus(request, onEvent) { return this.run('RunConsensus', request, onEvent); }

  /** The research coordinator: {query, documents, maxIterations, reportName, ...}. */
  research(request, onEvent) { return this.run('RunResearch', request, onEvent); }

  /**
   * Each pattern's figures since the gateway started: [{pattern, runs, completed, partial,
   * failed, durationAvgSeconds, completionRate, consensusRate, rated, satisfied, accuracy}].
   */
  async patternStats({ timeoutMs = 10000 } = {}) {
    const res = await retrying(this,
      () => unary(this.gateway, 'GetPatternStats', {}, timeoutMs, this.metadata), refusedForNow);
    return res.patterns.map(readPatternStats);
  }

  /**
   * Whether a finished run's outcome (by the runId of its events) satisfied the user; resolves
   * with {pattern, stats}, the pattern's figures with this rating counted.
   */
  async recordFeedback(runId, satisfied, { timeoutMs = 10000 } = {}) {
    const res = await retrying(this, () => unary(this.gateway, 'RecordFeedback',
      { run_id: runId, satisfied: Boolean(satisfied) }, timeoutMs, this.metadata), refusedForNow);
    return { pattern: patternName(res.pattern), stats: readPatternStats(res.stats) };
  }
}

// -- an agent's own server --------------------------------------------------------------------

/**
 * A client of one agent's own gRPC server (mesh.v1.AgentService), for calls that skip the
 * broker: the agent's card, and a message handled directly (RT-011 peer-to-peer). The
 * address is the one the agent registered (listAgents).
 */
class AgentClient {
  constructor(address, { agentId = '', ...options } = {}) {
    this.agentId = agentId;
    const { credentials, metadata, channelOptions, stop } = security(options);
    this._stopLooking = stop;
    this.agent = new meshV1.AgentService(checkTarget(address), credentials, channelOptions);
    this.agent.meshMetadata = metadata;
  }

  close() {
    this._stopLooking();
    this.agent.close();
  }

  /** The agent's card: {agentId, agentTypes, capabilities, tools, description, actions}. */
  async describe({ timeoutMs = 10000 } = {}) {
    const { card } = await unary(this.agent, 'DescribeAgent', {}, timeoutMs);
    return { agentId: card.agent_id, agentTypes: card.agent_types,
      capabilities: card.capabilities,
      tools: card.tools.map((t) => ({ name: t.name, description: t.description })),
      description: card.description, actions: card.actions };
  }

  /**
   * Has the agent handle a message now, without the broker's queue: resolves with its answer
   * (a RESPONSE or ERROR message) or null when it had nothing to say.
   */
  async handle(to, content, { timeoutMs = 10000, ...options } = {}) {
    const message = buildMessage({ from: this.agentId, to, content, ...options });
    const res = await unary(this.agent, 'HandleMessage', { message }, timeoutMs);
    return res.response ? readMessage(res.response) : null;
  }
}

// -- a Node.js agent --------------------------------------------------------------------------

/**
 * The contract's files as server reflection gives them out. proto-loader merges the files of a
 * package into one (mesh_v1.proto, google_protobuf.proto), lists no imports and leaves type
 * names relative; a client that builds its schema from reflection (buf curl, grpcurl) needs
 * them as protoc writes them: each file naming the files it refers to, and every type name
 * fully qualified (.mesh.v1.Message, .google.protobuf.Struct).
 */
function reflectable(pkg) {
  const files = new Map();
  for (const { fileDescriptorProtos } of Object.values(pkg)) {
    for (const bin of fileDescriptorProtos || []) {
      const file = FileDescriptorProto.decode(bin);
      if (!files.has(file.name)) files.set(file.name, file);
    }
  }
  // Map entries named as protoc names them (field headers: HeadersEntry), which clients check.
  const entryName = (field) => `${field.split('_').filter(Boolean)
    .map((w) => w[0].toUpperCase() + w.slice(1)).join('')}Entry`;
  const nameEntries = (message) => {
    const nested = new Map((message.nestedType || []).map((n) => [n.name, n]));
    for (const field of message.field || []) {
      const entry = nested.get(field.typeName);
      if (entry && entry.options && entry.options.mapEntry) {
        entry.name = entryName(field.name);
        field.typeName = entry.name;
      }
    }
    (message.nestedType || []).forEach(nameEntries);
  };
  for (const file of files.values()) (file.messageType || []).forEach(nameEntries);
  // Every message and enum by its full name, and the file that declares it.
  const declared = new Map();
  const declare = (scope, message, file) => {
    const name = `${scope}.${message.name}`;
    declared.set(name, file);
    (message.nestedType || []).forEach((nested) => declare(name, nested, file));
    (message.enumType || []).forEach((e) => declared.set(`${name}.${e.name}`, file));
  };
  for (const file of files.values()) {
    (file.messageType || []).forEach((m) => declare(file.package, m, file));
    (file.enumType || []).forEach((e) => declared.set(`${file.package}.${e.name}`, file));
  }
  // A name as protobuf resolves it: from the innermost scope outwards.
  const resolve = (name, scope) => {
    if (name.startsWith('.')) return name;
    for (let at = scope; ; at = at.slice(0, Math.max(at.lastIndexOf('.'), 0))) {
      const candidate = at ? `${at}.${name}` : name;
      if (declared.has(candidate)) return `.${candidate}`;
      if (!at) return name;
    }
  };
  const encoded = [];
  for (const file of files.values()) {
    const dependency = new Set(file.dependency || []);
    const refer = (name, scope) => {
      const full = resolve(name, scope);
      const owner = declared.get(full.slice(1));
      if (owner && owner !== file) dependency.add(owner.name);
      return full;
    };
    const visit = (message, scope) => {
      const name = `${scope}.${message.name}`;
      for (const field of message.field || []) {
        if (field.typeName) field.typeName = refer(field.typeName, name);
      }
      (message.nestedType || []).forEach((nested) => visit(nested, name));
    };
    (file.messageType || []).forEach((m) => visit(m, file.package));
    for (const service of file.service || []) {
      for (const method of service.method || []) {
        method.inputType = refer(method.inputType, file.package);
        method.outputType = refer(method.outputType, file.package);
      }
    }
    file.dependency = [...dependency];
    encoded.push(FileDescriptorProto.encode(file).finish());
  }
  return { contract: { fileDescriptorProtos: encoded } };
}
const REFLECTED = reflectable(definition);

/** The health name of a process's readiness: SERVING on each of its agents' servers while
 * every agent it serves takes its messages (as the Python agents say it). */
const AGENTS_SERVICE = 'agentmesh.agents';
/** The agents this process serves, each {health, ready, said}. */
const servedHere = new Set();

/** Says AGENTS_SERVICE on the server of every agent this process serves. */
function sayServedHere() {
  const all = [...servedHere].every((one) => one.ready) ? 'SERVING' : 'NOT_SERVING';
  for (const one of servedHere) {
    if (one.said !== all) {
      one.said = all;
      one.health.setStatus(AGENTS_SERVICE, all);
    }
  }
}

/**
 * Serves an agent: its own gRPC server (Agent service, with grpc.health.v1 and reflection),
 * registered with the broker, taking its deliveries from a subscription. handler(message,
 * {signal, forward, client}) returns the response content (an object) or null; signal aborts
 * when the request's requester gave up (the broker withdrew it) or a direct caller cancelled.
 * A handler hands a REQUEST on instead of answering it with `return forward(agentId,
 * content?)`: the next agent answers the requester in its place (content defaults to the
 * request's). client is the agent's own MeshClient (its messages come from the agent), for
 * the handler's own sends, requests and gathers.
 * onRefused(err) hears of an answer the broker refused (a warning on the console by
 * default). Resolves once the agent takes its messages (subscribed, or registered for push):
 * its health for mesh.v1.AgentService says SERVING from then on, and NOT_SERVING while it has
 * lost the broker (after 10 s without a subscription it resolves all the same, and goes on
 * trying). A broker that cannot be reached yet as it starts is waited for up to
 * waitForBrokerMs (AGENTMESH_WAIT_FOR_BROKER seconds; 0 by default: the start fails once the
 * client's retries are spent), the server up and not ready meanwhile.
 */
async function serveAgent({ broker, agentId, agentTypes = [], capabilities = [],
  requiredFields = [], handler, description = 'A Node.js agent', actions = [],
  host = '127.0.0.1', port = 0,
  onRefused = (err) => console.warn(
    `${agentId}: the broker refused a frame: ${err.codeName}: ${err.message}`),
  leaseMs, maxLeaseExtensionMs, maxInFlight = 16, deliveryMode = 'PULL',
  healthPort = Number(process.env.AGENTMESH_AGENT_HEALTH_PORT || -1),
  waitForBrokerMs = Number(process.env.AGENTMESH_WAIT_FOR_BROKER || 0) * 1000, ...options }) {
  checkSubscription({ leaseMs, maxLeaseExtensionMs, maxInFlight });
  namesOf(agentTypes, 'agentTypes');
  namesOf(capabilities, 'capabilities');
  if (!(typeof waitForBrokerMs === 'number' && waitForBrokerMs >= 0
    && waitForBrokerMs < Infinity)) {
    throw new TypeError(`waitForBrokerMs must be 0 or more milliseconds (got ${
      waitForBrokerMs})`);
  }
  if (!(Number.isInteger(healthPort) && healthPort >= -1 && healthPort <= 65535)) {
    throw new TypeError(`healthPort must be a port, 0 for any free one, or -1 for none (got ${
      healthPort})`);
  }
  if (!DELIVERY_MODES.includes(deliveryMode)) {
    throw new TypeError(`deliveryMode ${JSON.stringify(deliveryMode)} is not one of `
      + DELIVERY_MODES.join(', '));
  }
  const serverTls = serverCredentials(options);
  // Its callers held to the credentials file, when it has one (health and reflection stay
  // open, for the probes).
  const credentialsFile = options.credentialsFile ?? process.env.AGENTMESH_CREDENTIALS_FILE;
  const credentials = credentialsFile ? new WatchedCredentials(credentialsFile) : null;
  const refusal = callerCheck(credentials, serverTlsFiles(options).mutual);
  const server = new grpc.Server();
  // What the handler returns for a delivery, or for a direct call (its forward returned
  // unsent then: askOnward below asks it through the broker).
  const answer = async (message, context, { direct = false } = {}) => {
    const to = message.replyTo || message.from;
    const correlationId = message.correlationId || message.messageId;
    // A broadcast is asked when its sender waits for answers: a gather's copy (every one
    // carries a correlation id) or one naming replyTo; a plain broadcast is told.
    const asked = message.type === 'REQUEST'
      || (message.type === 'BROADCAST' && Boolean(message.correlationId || message.replyTo));
    let content;
    try {
      content = await handler(message, { ...context, forward: forwarding(message), client });
      if (content instanceof Forward) {
        const forward = forwardOf(message, agentId, content);
        return direct ? forward : await handOn(message, forward);
      }
    } catch (err) {
      // What is asked always gets an answer: the error, as the Python agents send it (a
      // gather does not wait its timeout). Anything else is handed back (redelivered after
      // RT-011's backoff, see onDelivery, then dead-lettered), and so is anything the
      // handler asks to have later (RetryLater), asked or not.
      if (!asked || err instanceof RetryLater) throw err;
      return buildMessage({ from: agentId, to, type: 'ERROR', correlationId,
        content: { action: 'error', error: String(err && err.message ? err.message : err),
          reason: (err && err.name) || 'Error' } });
    }
    if (content === null || content === undefined) {
      if (message.type !== 'REQUEST') return null;
      content = {};
    }
    // A broadcast nobody asked is not answered: an alert to every agent does not bring every
    // agent's answer back.
    if (message.type === 'BROADCAST' && !asked) return null;
    // Any other JSON value (a number, a string, an array) goes as {result: value}, as the
    // Python agents send it (spread, a string would arrive as {"0": ..., "1": ...}).
    const fields = typeof content === 'object' && !Array.isArray(content) ? content
      : { result: content };
    const reply = { action: (message.content && message.content.action) || 'response', ...fields };
    try {
      return buildMessage({ from: agentId, to, type: 'RESPONSE', content: reply, correlationId });
    } catch (err) {
      // An answer JSON cannot carry (NaN, a BigInt, a Map, nested too deep or circular):
      // whoever waits hears why now, as from the Python agents, not at its deadline; the
      // delivery is settled (no attempt would go otherwise).
      if (!(err instanceof TypeError)) throw err;
      return buildMessage({ from: agentId, to, type: 'ERROR', correlationId,
        content: { action: 'error', reason: 'AGENT_ERROR',
          error: `${agentId}'s answer was refused: content: ${err.message}` } });
    }
  };
  // A forward is sent as any send (waiting for the broker to take it, tried again under
  // backpressure); one refused (the next agent unknown, its queue full) is said to the
  // requester as an ERROR at once. Either way the delivery is settled (acked).
  const handOn = async (message, forward) => {
    try {
      await client._withRetry(() => client._ask({ send: forward }, 10000));
      return null;
    } catch (err) {
      if (!(err instanceof MeshError)) throw err;
      return buildMessage({ from: agentId, to: message.replyTo || message.from, type: 'ERROR',
        correlationId: message.correlationId || message.messageId,
        content: { action: 'error', reason: err.reason || err.codeName,
          error: `${agentId} could not hand the request on to ${forward.to_agent}: ${err.message}` } });
    }
  };
  // A direct call's request handed on is asked through the broker (the caller is not one of
  // its agents), and the next agent's answer goes back to the caller.
  const askOnward = async (message, forward, signal, deadline) => {
    const remaining = Number.isFinite(deadline) ? deadline - Date.now() : 30000;
    const { response } = await client._ask({ request: { message: { ...forward, reply_to: '' },
      timeout: toDuration(Math.max(remaining, 1)) } }, remaining + 1000,
    { cancellable: true, signal });
    return { ...response, to_agent: message.replyTo || message.from };
  };
  // (a request that cannot be read is refused INVALID_ARGUMENT, as by every server of the mesh)
  const unreadable = (call, callback) => {
    const why = call.request[WIRE] && call.request[WIRE].unreadable;
    if (why) callback(invalidArgument([['', why]]));
    return Boolean(why);
  };
  server.addService(readableService(meshV1.AgentService.service), {
    HandleMessage: (call, callback) => {
      if (unreadable(call, callback)) return;
      const aborting = new AbortController(); // the caller gave up: the handler may stop
      call.on('cancelled', () => aborting.abort(new MeshError({ code: grpc.status.CANCELLED,
        details: 'the caller cancelled the call' })));
      const pb = call.request.message || NO_MESSAGE; // (read as the empty message it stands for)
      const refused = refusal(call, pb.from_agent, 'send');
      if (refused) {
        callback(refused);
        return;
      }
      const wrong = wireViolations(pb, call.request[WIRE].bytes);
      if (wrong.length) {
        callback(invalidArgument(wrong));
        return;
      }
      const message = readMessage(pb);
      const violations = directViolations(message, agentId, requiredFields);
      if (violations.length) {
        callback(invalidArgument(violations));
        return;
      }
      const deadline = Number(call.getDeadline());
      answer(message, { signal: aborting.signal,
        maxDeliveryAttempts: call.request.max_delivery_attempts || 0,
        attempt: call.request.delivery_attempt || 1 }, { direct: true })
        .then((response) => (response && response.message_type === 'MESSAGE_TYPE_REQUEST'
          ? askOnward(message, response, aborting.signal, deadline) : response))
        .then((response) => callback(null, { response }))
        .catch((err) => {
          if (err instanceof MeshError) {
            callback({ code: err.code, details: err.message });
            return;
          }
          if (err instanceof RetryLater) { // (the broker's push hands the message back for then)
            callback(richError(grpc.status.UNAVAILABLE, err.message,
              { reason: 'RETRY_LATER', retryAfterMs: err.afterMs }));
            return;
          }
          // Said here, with its stack; the caller hears only that it failed, as from the
          // Python agents (a request that fails gets the error in an ERROR answer instead).
          console.error(`${agentId} failed on ${message.type} ${message.messageId}:`, err);
          callback({ code: grpc.status.INTERNAL, details: 'the handler failed' });
        });
    },
    DescribeAgent: (call, callback) => unreadable(call, callback) || callback(refusal(call), {
      card: { agent_id: agentId, agent_types: agentTypes, capabilities, tools: [],
        description, actions },
    }),
    // The broker's notice that the agent was deregistered: a pushed agent holds no session
    // whose end would tell it. One that pulls learns it from its subscription instead.
    NotifyDeregistered: (call, callback) => {
      if (unreadable(call, callback)) return;
      const named = call.request.agent_id;
      const refused = refusal(call, named, 'deregister');
      if (refused) {
        callback(refused);
        return;
      }
      if (named !== agentId) {
        callback(invalidArgument([['agent_id', `this server serves ${agentId}, not ${named}`]]));
        return;
      }
      callback(null, {});
      if (deliveryMode === 'PUSH' && !stopped && !deregistered) {
        deregistered = true;
        if (watch) watch.cancel();
        if (wake) wake();
        takenOff();
      }
    },
  });
  // As every server of the mesh: grpc.health.v1 and server reflection, so that plain gRPC
  // tools (buf curl, grpcurl, probes) find their way. The server as a whole ('', which
  // liveness asks) serves until it stops; mesh.v1.AgentService (readiness) only while the
  // agent takes its messages: subscribed (pull), or registered with a broker that serves
  // (push).
  // agentmesh.agents (AGENTS_SERVICE) says the readiness of the process: SERVING while every
  // agent it serves takes its messages.
  const health = new HealthImplementation(
    { '': 'SERVING', 'mesh.v1.AgentService': 'NOT_SERVING', [AGENTS_SERVICE]: 'NOT_SERVING' });
  let stopped = false;
  let deregistered = false;
  const here = { health, ready: false, said: 'NOT_SERVING' }; // (one of servedHere)
  let tookFirst;
  const firstTake = new Promise((resolve) => { tookFirst = resolve; });
  const takesMessages = (yes) => {
    if (yes) tookFirst();
    if (stopped || yes === here.ready) return; // (a watcher is told each setStatus, same or not)
    here.ready = yes;
    health.setStatus('mesh.v1.AgentService', yes ? 'SERVING' : 'NOT_SERVING');
    sayServedHere();
  };
  health.addToServer(server);
  new ReflectionService(REFLECTED, { services: ['mesh.v1.AgentService'] }).addToServer(server);
  const boundPort = await new Promise((resolve, reject) => {
    server.bindAsync(`${host}:${port}`, serverTls,
      (err, p) => (err ? reject(err) : resolve(p)));
  });
  const address = `${host}:${boundPort}`;
  // A health port: grpc.health.v1 alone (the same statuses), in plaintext beside a TLS server,
  // for probes that cannot speak TLS (a kubelet's gRPC probe).
  let healthServer = null;
  let healthAddress = null;
  if (healthPort >= 0) {
    healthServer = new grpc.Server();
    health.addToServer(healthServer);
    const bound = await new Promise((resolve, reject) => {
      healthServer.bindAsync(`${host}:${healthPort}`, grpc.ServerCredentials.createInsecure(),
        (err, p) => (err ? reject(err) : resolve(p)));
    });
    healthAddress = `${host}:${bound}`;
  }
  servedHere.add(here); // (from here on: a start that fails takes it out again)
  sayServedHere();
  const client = new MeshClient(broker, { agentId, ...options });
  // (maxInFlight: what the broker's push calls at once; else the session's window, below)
  const registration = { agentTypes, address, capabilities, deliveryMode, requiredFields,
    maxInFlight: deliveryMode === 'PUSH' ? maxInFlight : 0 };
  const delays = [100, 500, 1000, 2000]; // (as the Python and Go agents wait)
  // A broker not reachable yet (started beside the agent, as a deployment does) is waited
  // for up to waitForBrokerMs, the server up meanwhile and not ready.
  const giveUp = Date.now() + waitForBrokerMs;
  for (let attempt = 0; ; attempt += 1) {
    try {
      await client.register(registration);
      break;
    } catch (err) {
      const delayMs = delays[Math.min(attempt, delays.length - 1)];
      if (err.codeName !== 'UNAVAILABLE' || Date.now() + delayMs > giveUp) {
        servedHere.delete(here);
        sayServedHere();
        client.close();
        server.forceShutdown();
        if (healthServer) healthServer.forceShutdown();
        throw err;
      }
      if (attempt === 0) {
        console.warn(`${agentId} at ${address} waits for its broker (${err.message}): for ${
          Math.round((giveUp - Date.now()) / 1000)} s at most`);
      }
      await new Promise((resolve) => { setTimeout(resolve, delayMs); });
    }
  }
  // A handler that throws on a message nobody waits for (a hand-off, a plain broadcast)
  // hands it back after RT-011's backoff: 100 ms after the first attempt, 500 ms after the
  // second, 2 s after each later one (none after the broker's last, when it goes to the
  // dead-letter queue: RT-011's fourth from a broker that does not say), held meanwhile with
  // its lease kept, as the Python agents and push delivery wait, so that a failure that lasts
  // a moment is not met again at once. Stopping cuts it short.
  let stoppedNow;
  const whenStopped = new Promise((resolve) => { stoppedNow = resolve; });
  const onDelivery = async (message, attempt, context) => {
    try {
      return await answer(message, context);
    } catch (err) {
      const last = context.maxDeliveryAttempts || DELIVERY_ATTEMPTS;
      if (!(err instanceof Reject) && !(err instanceof RetryLater) && !stopped
        && attempt < last) {
        const delayMs = RETRY_DELAYS_MS[Math.min(Math.max(attempt, 1), RETRY_DELAYS_MS.length) - 1];
        let timer;
        await Promise.race([whenStopped,
          new Promise((resolve) => { timer = setTimeout(resolve, delayMs); })]);
        clearTimeout(timer);
      }
      throw err;
    }
  };
  // The subscription lives as long as the agent: when its stream ends or fails (the broker
  // restarted, the network went away), the agent registers again (a restarted broker may
  // have forgotten it) and subscribes again, waiting a little longer after each failure.
  let subscription = null;
  let wake = null;
  // Taken off the mesh on purpose (agentmesh deregister): not registered again behind the
  // back of whoever did it. The server stays, not ready, until stopped.
  const takenOff = () => {
    takesMessages(false);
    console.warn(`${agentId} was deregistered: it takes no more messages `
      + '(start it again to register it again)');
  };
  const keepSubscribed = async () => {
    let attempt = 0;
    while (!stopped) {
      try {
        if (attempt) {
          await client.register(registration);
        }
        // (Naming its instance: should this process die, the broker takes it off.)
        subscription = client.session(onDelivery,
          { leaseMs, maxLeaseExtensionMs, maxInFlight, instance: address });
        subscription.on('refused', onRefused);
        const ended = await new Promise((resolve) => {
          subscription.on('error', resolve);
          subscription.on('end', resolve);
          subscription.on('subscribed', () => { attempt = 0; takesMessages(true); });
          wake = resolve;
        });
        if (ended && ended.reason === 'AGENT_DEREGISTERED') {
          takenOff();
          return;
        }
      } catch (err) {
        // not registered: the broker is away; try again below
      }
      if (stopped) return;
      takesMessages(false);
      await new Promise((resolve) => {
        wake = resolve;
        setTimeout(resolve, delays[Math.min(attempt, delays.length - 1)]);
      });
      attempt += 1;
    }
  };
  // Push: the broker calls HandleMessage above with each message; no session to keep, but
  // a watch of the broker's health: a broker restarted on the memory store forgot the agent,
  // which registers again once it serves.
  let watch = null;
  const keepRegistered = async () => {
    const { credentials, channelOptions, stop } = security(options);
    stop(); // (health needs no token: nothing to look at)
    const healthClient = new HealthClient(broker, credentials,
      { ...channelOptions, channelOverride: client.broker.getChannel() });
    let lost = false;
    let attempt = 0;
    while (!stopped && !deregistered) {
      await new Promise((resolve) => {
        wake = resolve;
        watch = healthClient.Watch({ service: 'mesh.v1.BrokerService' });
        watch.on('data', (reply) => {
          attempt = 0;
          if (reply.status !== 'SERVING') {
            lost = true;
            takesMessages(false);
            return;
          }
          if (!lost) return;
          lost = false;
          client.register(registration)
            .then(() => { if (!deregistered) takesMessages(true); })
            .catch((err) => {
              lost = true; // (registered on the broker's next change, or its next watch)
              console.warn(`${agentId}: could not register again: ${err.message}`);
            });
        });
        watch.on('error', resolve);
        watch.on('end', resolve);
      });
      if (stopped || deregistered) return;
      lost = true;
      takesMessages(false);
      await new Promise((resolve) => {
        wake = resolve;
        setTimeout(resolve, delays[Math.min(attempt, delays.length - 1)]);
      });
      attempt += 1;
    }
  };
  if (deliveryMode === 'PUSH') takesMessages(true); // (registered above: the broker calls us)
  const running = deliveryMode === 'PUSH' ? keepRegistered() : keepSubscribed();
  let stopping = null;
  const stopOnce = async (graceMs) => {
    stopped = true;
    stoppedNow();
    // Out of service first: probes and callers look elsewhere while it finishes its work.
    health.setStatus('', 'NOT_SERVING');
    health.setStatus('mesh.v1.AgentService', 'NOT_SERVING');
    health.setStatus(AGENTS_SERVICE, 'NOT_SERVING');
    servedHere.delete(here); // (no longer one of the process's: the others' readiness is theirs)
    sayServedHere();
    if (subscription) await subscription.close(graceMs);
    if (watch) watch.cancel();
    if (wake) wake();
    await running;
    // Once, without retries: a broker that is away forgets it by itself. Only this
    // instance leaves: other processes serving the same agent id keep it on the mesh.
    await unary(client.broker, 'DeregisterAgent', { agent_id: agentId, address }, 2000)
      .catch(() => {});
    client.close();
    if (credentials) credentials.stop();
    await new Promise((resolve) => server.tryShutdown(resolve));
    if (healthServer) await new Promise((resolve) => healthServer.tryShutdown(resolve));
  };
  // Resolved once the agent takes its messages, as its readiness says SERVING; a broker that
  // lets it not subscribe within 10 s leaves it trying on its own (NOT_SERVING meanwhile).
  let waited;
  await Promise.race([firstTake, new Promise((resolve) => { waited = setTimeout(resolve, 10000); })]);
  clearTimeout(waited);
  return {
    address,
    /** host:port of its plaintext health server (healthPort), or null. */
    healthAddress,
    /** Stops serving (once: a second call waits for the first). */
    stop(graceMs = 5000) {
      stopping = stopping || stopOnce(graceMs);
      return stopping;
    },
  };
}

module.exports = {
  MeshClient, GatewayClient, AgentClient, MeshError, Reject, RetryLater, serveAgent,
  buildMessage, readMessage,
  toStruct, fromStruct, toRequest, toDuration, security, serverCredentials, TYPES, PROTO_ROOT,
};
