/**
 * The code that watches relayed messages decides when a pooled backend is free and whether a reset
 * can clean it (IdleWatch), when a login is over and what its cancel key is (LoginWatch), and what a
 * backend must be told for a session's statements to follow it (StatementRelay). Each
 * is fed whole exchanges, cut at every byte into two chunks, and one byte at a time, as ws's
 * receiver and pg-protocol's parser are tested: the verdict never depends on where TCP cut.
 */
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { IdleWatch, type Ending } from '../proxy/pool/idle-watch'
import { LoginWatch } from '../proxy/wire/startup'
import { BackendStatements, StatementRelay } from '../proxy/pool/prepared'
import { Framer, FramingError, MessageTooLarge } from '../proxy/wire/bytes'
import { cstrings, int32, message, queryMessage, TERMINATE } from './support/protocol'

const z = (status: string) => message('Z', Buffer.from(status))
const none = Buffer.alloc(0)
const parse = (sql: string) => message('P', Buffer.concat([cstrings(['', sql]), Buffer.from([0, 0])]))
const bind = message('B', Buffer.concat([cstrings(['', '']), Buffer.from([0, 0, 0, 0, 0, 0])]))
const describe = message('D', Buffer.from('P\0'))
const execute = message('E', Buffer.concat([Buffer.from('\0'), int32(0)]))
const sync = message('S', none)
const rowDescription = message('T', Buffer.from([0, 0]))
const complete = (tag: string) => message('C', cstrings([tag]))
const error = message('E', Buffer.from('SERROR\0C42703\0Mno such column\0\0'))

/** Every way to cut `bytes` into chunks: two at each byte, and one byte each. */
function* cuts(bytes: Buffer): Generator<Buffer[]> {
  for (let at = 0; at <= bytes.length; at++) yield [bytes.subarray(0, at), bytes.subarray(at)]
  yield [...bytes].map((b) => Buffer.from([b]))
}

interface Exchange {
  name: string
  client: Buffer
  backend: Buffer
  /** How the session leaves its backend once all is through. */
  ending: Ending
  readies: number
}

const exchanges: Exchange[] = [
  { name: 'a simple query', client: queryMessage('SELECT 1'), backend: Buffer.concat([rowDescription, complete('SELECT 1'), z('I')]), ending: { pending: 0, status: 0x49, reusable: true }, readies: 1 },
  {
    name: 'the extended protocol',
    client: Buffer.concat([parse('SELECT $1'), bind, describe, execute, sync]),
    backend: Buffer.concat([message('1', none), message('2', none), rowDescription, complete('SELECT 1'), z('I')]),
    ending: { pending: 0, status: 0x49, reusable: true },
    readies: 1,
  },
  { name: 'a transaction left open', client: queryMessage('BEGIN'), backend: Buffer.concat([complete('BEGIN'), z('T')]), ending: { pending: 0, status: 0x54, reusable: true }, readies: 1 },
  { name: 'a failed statement', client: queryMessage('SELECT nope'), backend: Buffer.concat([error, z('I')]), ending: { pending: 0, status: 0x49, reusable: true }, readies: 1 },
  {
    name: 'two queries pipelined',
    client: Buffer.concat([queryMessage('SELECT 1'), parse('SELECT 2'), bind, execute, sync]),
    backend: Buffer.concat([complete('SELECT 1'), z('I'), message('1', none), message('2', none), complete('SELECT 1'), z('I')]),
    ending: { pending: 0, status: 0x49, reusable: true },
    readies: 2,
  },
  { name: 'a custom setting', client: queryMessage("SET app.user_id = '42'"), backend: Buffer.concat([complete('SET'), z('I')]), ending: { pending: 0, status: 0x49, reusable: false }, readies: 1 },
  { name: 'set_config in a prepared statement', client: Buffer.concat([parse("SELECT set_config('app.x', $1, false)"), bind, execute, sync]), backend: Buffer.concat([message('1', none), message('2', none), complete('SELECT 1'), z('I')]), ending: { pending: 0, status: 0x49, reusable: false }, readies: 1 },
]

/**
 * Whether a Query or Parse is cut so that its text cannot be read whole: its header ends in one
 * chunk and its body goes on into the next. Such a statement counts as one that may set something.
 */
function cutsAStatement(chunks: Buffer[]): boolean {
  const ends: number[] = [] // each chunk's end offset in the stream
  chunks.reduce((at, c) => (ends.push(at + c.length), at + c.length), 0)
  const stream = Buffer.concat(chunks)
  for (let at = 0; at + 5 <= stream.length; at += 1 + stream.readInt32BE(at + 1)) {
    if (stream[at] !== 0x51 && stream[at] !== 0x50) continue
    const headerEndsIn = ends.findIndex((e) => e > at + 4)
    if (ends[headerEndsIn] < at + 1 + stream.readInt32BE(at + 1)) return true
  }
  return false
}

for (const x of exchanges) {
  test(`IdleWatch, ${x.name}: the same verdict wherever the bytes are cut`, () => {
    for (const clientChunks of cuts(x.client)) {
      const passed = new IdleWatch()
      assert.ok(Buffer.concat(clientChunks.map((c) => passed.fromClient(c))).equals(x.client), 'every client byte is passed on')
      assert.equal(passed.ending, undefined, 'busy until Postgres has answered')
      for (const backendChunks of cuts(x.backend)) {
        const watch = new IdleWatch()
        for (const c of clientChunks) watch.fromClient(c)
        const where = `client cut ${clientChunks.map((c) => c.length)}, backend cut ${backendChunks.map((c) => c.length)}`
        for (const c of backendChunks) {
          watch.fromBackend(c)
          // Never idle in a status other than the one Postgres is saying.
          if (watch.ending?.pending === 0 && c !== backendChunks.at(-1)) assert.equal(watch.ending.status, x.ending.status, `early verdict (${where})`)
        }
        assert.deepEqual(watch.ending, { ...x.ending, reusable: x.ending.reusable && !cutsAStatement(clientChunks) }, where)
        assert.equal(watch.readies, x.readies)
      }
    }
  })
}

test('IdleWatch: a Terminate is taken out wherever it is cut; one cut in two leaves the backend not reusable', () => {
  const client = Buffer.concat([queryMessage('SELECT 1'), TERMINATE])
  const terminateAt = client.length - TERMINATE.length
  for (const chunks of cuts(client)) {
    const watch = new IdleWatch()
    const passed = Buffer.concat(chunks.map((c) => watch.fromClient(c)))
    // Its first bytes go on when they come before its type can be known: then the backend is not reused.
    const cutInside = chunks.length > 2 || (chunks[0].length > terminateAt && chunks[0].length < client.length)
    assert.equal(watch.terminated, true)
    assert.ok(passed.equals(client.subarray(0, passed.length)) && passed.length >= terminateAt, 'the query is passed on, the Terminate held back')
    watch.fromBackend(Buffer.concat([complete('SELECT 1'), z('I')]))
    assert.equal(watch.ending?.reusable, !cutInside && !cutsAStatement(chunks), `cut ${chunks.map((c) => c.length)}`)
  }
})

test('LoginWatch: the cancel key and the ReadyForQuery that ends the login, wherever the bytes are cut', () => {
  const secret = Buffer.alloc(32, 0xab)
  const key = message('K', Buffer.concat([int32(12345), secret]))
  const param = message('S', cstrings(['server_version', '18.0']))
  const login = Buffer.concat([message('R', int32(0)), param, param, key, z('I')])
  for (const chunks of cuts(login)) {
    const watch = new LoginWatch()
    let done = false
    for (const c of chunks.filter((c) => c.length)) {
      assert.equal(done, false, 'done only at the ReadyForQuery, its last byte')
      done = watch.feed(c)
    }
    assert.equal(done, true, `done (cut ${chunks.map((c) => c.length)})`)
    assert.deepEqual(watch.key, { pid: 12345, secret })
    assert.equal(watch.ready, true)
  }
  for (const chunks of cuts(Buffer.concat([message('R', int32(10)), error]))) {
    const watch = new LoginWatch()
    const done = chunks.map((c) => watch.feed(c)).some(Boolean)
    assert.equal(done, true, 'an ErrorResponse ends it')
    assert.equal(watch.ready, false, 'a refused login is not ready')
  }
})

test('StatementRelay: the same bytes to Postgres and to the client wherever they are cut', () => {
  const named = (name: string, text: string) => message('P', Buffer.concat([cstrings([name, text]), Buffer.from([0, 0])]))
  const bindNamed = (name: string) => message('B', Buffer.concat([cstrings(['', name]), Buffer.from([0, 0, 0, 0, 0, 0])]))
  const describeNamed = (name: string) => message('D', Buffer.concat([Buffer.from('S'), cstrings([name])]))
  const described = Buffer.concat([message('t', Buffer.from([0, 0])), message('n', none)]) // ParameterDescription, NoData
  const session = () => new Map([['s1', named('s1', 'SELECT 1')]])
  // s1 is the session's but not this backend's: the relay prepares it first, and describes it, and
  // describes s2 behind the session's Parse; those answers are the proxy's.
  const client = Buffer.concat([bindNamed('s1'), execute, named('s2', 'SELECT 2'), sync])
  const backend = Buffer.concat([message('1', none), described, message('2', none), complete('SELECT 1'), message('1', none), described, z('I')])
  const run = (clientChunks: Buffer[], backendChunks: Buffer[]) => {
    const sent: Buffer[] = []
    const relay = new StatementRelay(session(), new BackendStatements(), (b) => sent.push(b))
    for (const c of clientChunks) relay.fromClient(c)
    return { sent: Buffer.concat(sent), seen: Buffer.concat(backendChunks.map((c) => relay.fromBackend(c))) }
  }
  const whole = run([client], [backend])
  const [bind, , parse2] = [bindNamed('s1'), execute, named('s2', 'SELECT 2')]
  assert.ok(whole.sent.equals(Buffer.concat([named('s1', 'SELECT 1'), describeNamed('s1'), bind, execute, parse2, describeNamed('s2'), sync])), 'the statement prepared (and described) ahead of the Bind')
  assert.ok(whole.seen.equals(Buffer.concat([message('2', none), complete('SELECT 1'), message('1', none), z('I')])), "the proxy's ParseComplete and descriptions are not the client's")
  for (const clientChunks of cuts(client)) assert.ok(run(clientChunks, [backend]).sent.equals(whole.sent), `client cut ${clientChunks.map((c) => c.length)}`)
  for (const backendChunks of cuts(backend)) assert.ok(run([client], backendChunks).seen.equals(whole.seen), `backend cut ${backendChunks.map((c) => c.length)}`)
})

const bigMessage = message('d', Buffer.alloc(300, 0x61)) // (CopyData: its body longer than a header's worth)
const sequences: Record<string, Buffer[]> = {
  'a query, a Sync, a ReadyForQuery': [queryMessage('SELECT 1'), sync, z('I')],
  'empty bodies back to back': [sync, sync, message('H', none), sync],
  'extended protocol': [parse('SELECT $1'), bind, describe, execute, sync],
  'a long message between short ones': [sync, bigMessage, queryMessage('SELECT 2'), bigMessage],
}

for (const [name, sequence] of Object.entries(sequences)) {
  test(`Framer, ${name}: the same messages wherever the bytes are cut`, () => {
    const stream = Buffer.concat(sequence)
    const expected = sequence.map((m) => m.toString('hex'))
    for (const chunks of cuts(stream)) {
      const framer = new Framer()
      const out: Buffer[] = []
      let fed = 0
      for (const chunk of chunks) {
        out.push(...framer.push(chunk))
        fed += chunk.length
        // What is held is the message under way: its declared length once its header is in, else the bytes so far.
        const done = out.reduce((n, m) => n + m.length, 0)
        const underWay = fed - done >= 5 ? 1 + stream.readInt32BE(done + 1) : fed - done
        assert.equal(framer.holding, underWay, `holding after ${fed} bytes, cut ${chunks.map((c) => c.length)}`)
      }
      assert.deepEqual(out.map((m) => m.toString('hex')), expected, `cut ${chunks.map((c) => c.length)}`)
      assert.equal(framer.holding, 0)
    }
    // Three chunks, cut at every pair of bytes.
    for (let i = 0; i <= stream.length; i++) {
      for (let j = i; j <= stream.length; j++) {
        const framer = new Framer()
        const out = [stream.subarray(0, i), stream.subarray(i, j), stream.subarray(j)].flatMap((c) => framer.push(c))
        assert.deepEqual(out.map((m) => m.toString('hex')), expected, `cut at ${i} and ${j}`)
      }
    }
  })
}

test('Framer: a length no message can have is an error, not a stall, wherever its header is cut', () => {
  for (const bad of [Buffer.from([0x51, 0xff, 0xff, 0xff, 0xfe]), Buffer.from([0x51, 0, 0, 0, 3])]) {
    for (const chunks of cuts(Buffer.concat([sync, bad]))) {
      const framer = new Framer()
      assert.throws(() => chunks.forEach((c) => framer.push(c)), FramingError, `cut ${chunks.map((c) => c.length)}`)
    }
  }
})

test('Framer: a message longer than its limit is refused at its header, before its body is in', () => {
  const limit = bigMessage.length - 1
  const tooLarge = (err: unknown) => err instanceof MessageTooLarge && err.length === bigMessage.length && err.limit === limit
  for (let at = 0; at < 5; at++) {
    const framer = new Framer(limit)
    assert.equal(framer.push(Buffer.concat([sync, bigMessage.subarray(0, at)])).length, 1)
    assert.throws(() => framer.push(bigMessage.subarray(at, 5)), tooLarge, `header cut at ${at}`)
  }
  assert.throws(() => new Framer(limit).push(Buffer.concat([sync, bigMessage.subarray(0, 5)])), tooLarge, 'header whole')
  assert.equal(new Framer(bigMessage.length).push(bigMessage).length, 1, 'one of the limit is taken')
})

test('Framer: a message cut into many small pieces costs time in proportion to its size', () => {
  const body = Buffer.alloc(16 << 20, 0x62)
  const whole = message('d', body)
  const framer = new Framer()
  const started = performance.now()
  let out: Buffer[] = []
  for (let at = 0; at < whole.length; at += 2048) out = out.concat(framer.push(whole.subarray(at, at + 2048)))
  const ms = performance.now() - started
  assert.equal(out.length, 1)
  assert.ok(out[0].equals(whole))
  assert.ok(ms < 2000, `16 MB in 2 KB pieces took ${ms.toFixed(0)} ms`) // (re-copied at each piece, it took minutes)
})
