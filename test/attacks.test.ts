/**
 * edgepg-proxy faces the internet: what a client without credentials can make it hold is bounded,
 * and freed within a known time, while a legitimate client is served. Against the real proxy and
 * Postgres; attackers connect from 127.0.0.2 and up, the legitimate client from 127.0.0.1.
 * - Memory: WebSocket frames that declare 60 MiB and stop a byte short. Before login a message may
 *   be 64 KiB; after it, what all unfinished messages hold stays within --max-client-buffer (a
 *   proxy in a child process, its RSS read from /proc).
 * - POST /sql: bodies that never finish hold a slot only until the read timeout, and at most
 *   `maxRequestsPerIp` at once from one address; odd requests (a doubled connection string, too
 *   many params, JSON nested past the stack) get a 400 that says what is wrong and echoes no secret.
 * - A WebSocket that never answers the proxy's close frame is cut a second later.
 * - Logins that never answer Postgres's authentication request: at most --max-logins-per-ip per
 *   address at Postgres at once (counted on the proxy's sockets until ReadyForQuery), in every
 *   login mode; a legitimate login connects at once; the handshake timeout cuts each.
 * - CancelRequests: one naming a key the proxy never issued opens no connection to Postgres; all
 *   are limited per address.
 */
import { test, describe, before, after } from 'node:test'
import assert from 'node:assert/strict'
import net from 'node:net'
import { WebSocket } from 'ws'
import pg from 'pg'
import { startProxy, pgConfig, within, eventually, edgeClient } from './support/helpers'
import { Client } from '../src/index'
import { startChildProxy, startGcProxy, type GcProxy, type MemoryUsage } from './support/child-proxy'
import { int32, message, passwordMessage, queryMessage, startupMessage } from './support/protocol'
import { LOGIN_PREFIX, SUBPROTOCOL } from '../src/config'
import { Cancels } from '../proxy/ws/cancels'
import { BackendPool } from '../proxy/pool/backends'

const READ_TIMEOUT_MS = 1000
const PER_IP = 20
const HANDSHAKE_MS = 500
let proxy: Awaited<ReturnType<typeof startProxy>>
before(async () => (proxy = await startProxy({ sql: { readTimeoutMs: READ_TIMEOUT_MS, maxRequestsPerIp: PER_IP }, handshakeTimeoutMs: HANDSHAKE_MS })))
after(() => proxy?.close())

const { user, password, host, port, database } = pgConfig('scram_user') as Record<string, string>
const connectionString = `postgresql://${user}:${encodeURIComponent(password)}@${host}:${port}/${database}`
const post = (body: string, headers: Record<string, string | string[]> = { 'Neon-Connection-String': connectionString }) =>
  fetch(`http://127.0.0.1:${proxy.port}/sql`, { method: 'POST', headers: headers as any, body }).then(async (res) => ({ status: res.status, body: await res.json() }))

/** A POST whose body never comes (20 of its 100 bytes), from `localAddress`: resolves with the status line the proxy answers, or '' if it hangs up. */
function neverFinishing(localAddress: string): Promise<string> {
  return new Promise((resolve) => {
    const socket = net.connect({ host: '127.0.0.1', port: proxy.port, localAddress })
    let answer = ''
    socket.on('connect', () => socket.write(`POST /sql HTTP/1.1\r\nHost: x\r\nNeon-Connection-String: ${connectionString}\r\nContent-Length: 100\r\n\r\n{"query": "SELECT 1"`))
    socket.on('data', (d) => (answer += d))
    socket.on('error', () => {})
    socket.on('close', () => resolve(answer.split('\r\n')[0]))
  })
}

test('bodies that never finish, from one address: a few hold slots until the read timeout, the rest get 429; another address is served throughout', async () => {
  const attack = Array.from({ length: 200 }, () => neverFinishing('127.0.0.2'))
  await new Promise((r) => setTimeout(r, 300)) // the attack is in place
  const start = performance.now()
  const served = await post(JSON.stringify({ query: 'SELECT 42 AS answer' }))
  assert.equal(served.status, 200, JSON.stringify(served.body))
  assert.deepEqual(served.body.rows, [{ answer: 42 }])
  assert.ok(performance.now() - start < READ_TIMEOUT_MS, 'the legitimate request did not wait for the attack')
  const answers = await within(READ_TIMEOUT_MS + 5000, 'every attacking request answered and closed', Promise.all(attack))
  const count = (line: string) => answers.filter((a) => a === line).length
  assert.equal(count('HTTP/1.1 408 Request Timeout'), PER_IP, `${PER_IP} held a slot until the read timeout: ${[...new Set(answers)]}`)
  assert.equal(count('HTTP/1.1 429 Too Many Requests'), 200 - PER_IP)
})

test('a doubled Neon-Connection-String is refused with 400, echoing no password', async () => {
  const other = connectionString.replace(encodeURIComponent(password), 'other-secret')
  const body = JSON.stringify({ query: 'SELECT 1' })
  // Two header lines (fetch would join them into one value), as a hand-made request sends them.
  const response = await new Promise<string>((resolve) => {
    const socket = net.connect({ host: '127.0.0.1', port: proxy.port })
    let answer = ''
    socket.on('connect', () =>
      socket.end(`POST /sql HTTP/1.1\r\nHost: x\r\nConnection: close\r\nNeon-Connection-String: ${connectionString}\r\nNeon-Connection-String: ${other}\r\nContent-Length: ${body.length}\r\n\r\n${body}`)
    )
    socket.on('data', (d) => (answer += d))
    socket.on('close', () => resolve(answer))
  })
  assert.match(response, /^HTTP\/1\.1 400 /)
  assert.match(response, /the neon-connection-string header is given 2 times; send it once/)
  assert.ok(!response.includes('other-secret') && !response.includes(encodeURIComponent(password)), `no password echoed: ${response}`)
})

test('more than 65,535 params and JSON nested past the stack are refused with 400 saying so', async () => {
  const params = Array.from({ length: 65536 }, (_, i) => i)
  const many = await post(JSON.stringify({ query: 'SELECT 1', params }))
  assert.equal(many.status, 400)
  assert.match(many.body.message, /65536 params; Postgres takes at most 65535/)
  const deep = await post(`{"query": "SELECT $1", "params": [${'['.repeat(1e6)}${']'.repeat(1e6)}]}`)
  assert.equal(deep.status, 400)
  assert.match(deep.body.message, /nested too deeply/)
})

test("a WebSocket that never answers the proxy's close frame holds its slot a second past it, not ws's 30 s", async () => {
  // An upgrade by hand, then silence: no startup, and no answer to the close that the handshake timeout sends.
  const socket = net.connect({ host: '127.0.0.1', port: proxy.port, localAddress: '127.0.0.2' })
  socket.on('error', () => {})
  socket.on('data', () => {}) // read, never answered
  await new Promise((r) => socket.once('connect', r))
  socket.write('GET /v2 HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n')
  const start = performance.now()
  await eventually(() => proxy.sessionCount === 1, 'the session to open')
  await eventually(() => proxy.sessionCount === 0, 'the slot to be freed', 10_000)
  const held = performance.now() - start
  assert.ok(held < HANDSHAKE_MS + 2500, `the slot was held ${Math.round(held)} ms (handshake timeout ${HANDSHAKE_MS} ms, then a second to answer the close)`)
  socket.destroy()
})

// ── memory ──────────────────────────────────────────────────────────────────────────────────

const MiB = 1 << 20
const FRAME_BYTES = 60 * MiB
const BUDGET = 128 * MiB

/** The login in the upgrade (proxy/login/in-upgrade.ts): a session that is logged in once it opens. */
const loginProtocols = () => [SUBPROTOCOL, LOGIN_PREFIX + Buffer.concat([startupMessage({ user, database }), passwordMessage(password)]).toString('base64url')]

/** A WebSocket to `port` from `localAddress`, open (a login in the upgrade has been answered by then). */
function attacker(port: number, protocols?: string[], localAddress = '127.0.0.2'): Promise<WebSocket> {
  const ws = new WebSocket(`ws://127.0.0.1:${port}/v2`, protocols, { localAddress })
  ws.on('error', () => {})
  return new Promise((resolve, reject) => {
    ws.once('open', () => resolve(ws))
    ws.once('unexpected-response', (_, res) => reject(new Error(`upgrade refused: ${res.statusCode}`)))
  })
}

/**
 * Sends one masked binary frame that declares FRAME_BYTES, all but its last byte, minding
 * backpressure; resolves with the close code, once the proxy closes it or `stop` is called.
 */
function unfinishedFrame(ws: WebSocket, stop: Promise<void>): Promise<number> {
  const socket = (ws as any)._socket as net.Socket
  const closed = new Promise<number>((resolve) => ws.once('close', (code) => resolve(code)))
  const header = Buffer.alloc(14)
  header[0] = 0x82 // FIN, binary
  header[1] = 0x80 | 127 // masked, 64-bit length
  header.writeBigUInt64BE(BigInt(FRAME_BYTES), 2)
  const chunk = Buffer.alloc(MiB, 0x61)
  void (async () => {
    socket.write(header)
    let ended = false
    void closed.then(() => (ended = true))
    void stop.then(() => (ended = true))
    for (let left = FRAME_BYTES - 1; left > 0 && !ended; left -= chunk.length) {
      if (!socket.write(left < chunk.length ? chunk.subarray(0, left) : chunk)) await drainedOrClosed(socket)
    }
  })()
  return Promise.race([closed, stop.then(() => (ws.terminate(), closed))])
}

/** The socket drained or closed (the other listener taken off: a write loop would pile them up). */
function drainedOrClosed(socket: net.Socket): Promise<void> {
  return new Promise((resolve) => {
    const done = () => (socket.off('drain', done).off('close', done), resolve())
    socket.once('drain', done).once('close', done)
  })
}

/**
 * What the proxy holds above `base` once an attack's sessions are gone, in MiB: RSS and Buffers
 * after a full GC, asked again for up to 20 s until both are down (a loaded machine's CI ran past
 * 10 s once). V8 frees Buffers as it sweeps, after the GC. What glibc gives back to the system of
 * what was freed varies from run to run: the reads a message came in, small ones in its heap, are
 * freed as V8 collects them, and a heap gives back only its top (docs/deployment.md, "Facing the internet").
 */
async function givenBack(child: GcProxy, base: MemoryUsage) {
  let now = await child.memoryAfterGc()
  const down = () => now.arrayBuffers - base.arrayBuffers < 8 * MiB && now.rss - base.rss < 32 * MiB
  await eventually(async () => down() || ((now = await child.memoryAfterGc()), down()), 'the memory to be given back', 20_000, 500).catch(() => {})
  const mib = (n: number) => `${(n / MiB).toFixed(1)} MiB`
  return {
    after: (now.rss - base.rss) / MiB,
    buffers: (now.arrayBuffers - base.arrayBuffers) / MiB,
    heap: `V8 heap ${mib(now.heapTotal)} (was ${mib(base.heapTotal)}), external ${mib(now.external)} (was ${mib(base.external)})`,
  }
}

describe('memory', { concurrency: false }, () => {
  let child: GcProxy
  // glibc keeps freed 64 KiB socket buffers in its heap; with this (docs/deployment.md, "Facing the internet") it hands them back.
  before(async () => (child = await startGcProxy(`${host}:${port}`, ['--max-client-buffer', String(BUDGET)], { MALLOC_MMAP_THRESHOLD_: '65536' })))
  after(() => child?.stop())

  /** A legitimate session on 127.0.0.1, kept querying while `during` runs: every query answered. */
  async function servedThroughout<T>(during: () => Promise<T>): Promise<T> {
    const client = edgeClient(child.port)
    await client.connect()
    let stop = false
    let answered = 0
    const querying = (async () => {
      for (; !stop; await new Promise((r) => setTimeout(r, 20))) {
        assert.deepEqual((await within(2000, 'a legitimate query under attack', client.query('SELECT 1 AS one'))).rows, [{ one: 1 }])
        answered++
      }
    })()
    try {
      return await during()
    } finally {
      stop = true
      await querying
      await client.end()
      assert.ok(answered > 0, 'the legitimate session was served throughout')
    }
  }

  /**
   * Runs `attack`, sampling the proxy's RSS: its growth at the peak, and once the attack's sessions
   * are gone and a GC has run (RSS, and what Buffers still hold), in MiB above `before` (default:
   * where it was when the attack began).
   */
  async function rssGrowth(attack: () => Promise<void>, before?: MemoryUsage) {
    before ??= await child.memoryAfterGc()
    const ended = child.logs.length
    let peak = child.rss()
    const sampler = setInterval(() => (peak = Math.max(peak, child.rss())), 50)
    try {
      await attack()
    } finally {
      clearInterval(sampler)
    }
    peak = Math.max(peak, child.rss())
    await eventually(() => child.logs.length >= ended + 21, "every session to end: the attack's 20 and the legitimate one")
    return { peak: (peak - before.rss) / MiB, ...(await givenBack(child, before)) }
  }

  test('20 frames of 60 MiB before login: each refused at its header (1009); the proxy grows by at most 64 MB; a legitimate session works throughout', async () => {
    let codes: number[] = []
    const growth = await rssGrowth(() =>
      servedThroughout(async () => {
        const sockets = await Promise.all(Array.from({ length: 20 }, () => attacker(child.port)))
        codes = await within(10_000, 'every unfinished frame refused', Promise.all(sockets.map((ws) => unfinishedFrame(ws, new Promise(() => {})))))
      })
    )
    assert.deepEqual(new Set(codes), new Set([1009]), `close codes ${codes}`)
    assert.ok(growth.peak <= 64, `the proxy grew by ${growth.peak.toFixed(1)} MiB`)
  })

  test(`the same from 20 logged-in sessions, three times over: what they hold stays within --max-client-buffer (${BUDGET / MiB} MiB), the largest past it closed with 1009; memory given back, none kept from one attack to the next`, async (t) => {
    const base = await child.memoryAfterGc()
    const afters: number[] = []
    let shedBefore = 0
    for (let round = 1; round <= 3; round++) {
      let codes: number[] = []
      const growth = await rssGrowth(
        () =>
          servedThroughout(async () => {
            const sockets = await Promise.all(Array.from({ length: 20 }, () => attacker(child.port, loginProtocols())))
            let stop!: () => void
            const stopped = new Promise<void>((r) => (stop = r))
            let closed = 0
            const frames = sockets.map((ws) => unfinishedFrame(ws, stopped).finally(() => closed++))
            // All but those the budget has room for (two frames of 60 MiB) are closed; those are held until the attack stops.
            await eventually(() => closed >= 20 - Math.floor(BUDGET / FRAME_BYTES), 'the sessions past the budget to be closed', 30_000)
            await new Promise((r) => setTimeout(r, 500))
            stop()
            codes = await Promise.all(frames)
          }),
        base
      )
      const shedCodes = codes.filter((c) => c === 1009).length
      assert.ok(shedCodes >= 20 - Math.floor(BUDGET / FRAME_BYTES), `round ${round}: closed with 1009: ${shedCodes} of 20 (codes ${codes})`)
      const metrics = await (await fetch(`http://127.0.0.1:${child.port}/metrics`)).text()
      const shed = Number(/^edgepg_proxy_sessions_total\{outcome_kind="over_budget"\} (\d+)$/m.exec(metrics)?.[1])
      assert.equal(shed - shedBefore, shedCodes, `round ${round}: counted in the metrics`)
      shedBefore = shed
      assert.match(metrics, /^edgepg_proxy_client_buffer_bytes 0$/m, 'nothing held once the sessions are gone')
      assert.ok(growth.peak <= BUDGET / MiB + 64, `round ${round}: the proxy grew by ${growth.peak.toFixed(1)} MiB (budget ${BUDGET / MiB} MiB)`)
      assert.ok(growth.buffers < 8, `round ${round}: nothing held once the sessions ended: Buffers ${growth.buffers.toFixed(1)} MiB above where they were`)
      afters.push(growth.after)
    }
    // Freed, what glibc keeps it reuses: each attack's 128 MiB come back no higher than the first's left RSS (held anew each round, they would add up to 384 MiB).
    const most = Math.max(...afters)
    t.diagnostic(`RSS once each attack's sessions had gone: ${afters.map((a) => a.toFixed(1)).join(', ')} MiB above where it was`)
    assert.ok(most < BUDGET / MiB, `given back once the sessions ended: RSS ${afters.map((a) => a.toFixed(1)).join(', ')} MiB above where it was before the first attack`)
  })
})

// ── a logged-in client's memory and CPU ────────────────────────────────────────────────────

/** A protocol message's header: its type and the length its body will make it. */
const header = (type: string, bodyBytes: number) => Buffer.concat([Buffer.from(type), int32(4 + bodyBytes)])
const sync = message('S', Buffer.alloc(0))

/**
 * Sends one protocol message of `type` with a body of `bodyBytes` (or all but its last byte:
 * `unfinished`), cut into binary WebSocket messages of `frame` bytes, a few MiB in flight at most.
 * Stops once the proxy closes `ws`; resolves with whether all of it went.
 */
async function sendCut(ws: WebSocket, type: string, bodyBytes: number, frame: number, unfinished = false): Promise<boolean> {
  const closed = new Promise<void>((r) => (ws.readyState >= ws.CLOSING ? r() : ws.once('close', () => r())))
  const fill = Buffer.alloc(frame, 0x61)
  const total = 5 + bodyBytes - (unfinished ? 1 : 0)
  for (let at = 0; at < total; at += frame) {
    if (ws.readyState !== ws.OPEN) return false
    const piece = at === 0 ? Buffer.concat([header(type, bodyBytes), fill.subarray(0, Math.min(frame, total) - 5)]) : fill.subarray(0, Math.min(frame, total - at))
    const sent = new Promise<void>((r) => ws.send(piece, () => r()))
    // (Yielding now and then, so that this process serves the legitimate session meanwhile.)
    if (ws.bufferedAmount > 4 * MiB || at % MiB < frame) await Promise.race([sent, closed])
  }
  return ws.readyState === ws.OPEN
}

/** The proxy's client_buffer_bytes, from /metrics. */
async function bufferBytes(port: number): Promise<number> {
  const metrics = await (await fetch(`http://127.0.0.1:${port}/metrics`)).text()
  return Number(/^edgepg_proxy_client_buffer_bytes (\d+)$/m.exec(metrics)?.[1])
}

/** Sends `messages` on a logged-in session; resolves once a ReadyForQuery is back. */
function ask(ws: WebSocket, messages: Buffer): Promise<void> {
  let seen = Buffer.alloc(0)
  return new Promise((resolve) => {
    const onMessage = (data: Buffer) => {
      seen = Buffer.concat([seen.subarray(-5), data])
      if (seen.includes(Buffer.from('Z\0\0\0\x05'))) ws.off('message', onMessage), resolve()
    }
    ws.on('message', onMessage)
    ws.send(messages)
  })
}

/** A logged-in session's close: its code and reason. */
const closing = (ws: WebSocket) => new Promise<{ code: number; reason: string }>((r) => ws.once('close', (code, reason) => r({ code, reason: String(reason) })))

describe("a logged-in client's memory and CPU (transaction pooling)", { concurrency: false }, () => {
  /** A legitimate session kept querying while `during` runs: each SELECT 1 answered within 2 s. */
  async function servedThroughout<T>(port: number, during: () => Promise<T>): Promise<T> {
    const client = edgeClient(port)
    await client.connect()
    await client.query('SELECT 1') // (its backend in the pool)
    let stop = false
    let answered = 0
    const querying = (async () => {
      for (; !stop; await new Promise((r) => setTimeout(r, 20))) {
        assert.deepEqual((await within(2000, 'a legitimate query under attack', client.query('SELECT 1 AS one'))).rows, [{ one: 1 }])
        answered++
      }
    })()
    querying.catch(() => {}) // (its failure is reported below, once the attack is over)
    try {
      return await during()
    } finally {
      stop = true
      await querying
      await client.end()
      assert.ok(answered > 0, 'the legitimate session was served throughout')
    }
  }

  test('16 MB in one protocol message, in 2 KB WebSocket messages: under 2 s of the proxy’s CPU, another session served meanwhile', async (t) => {
    const child = await startChildProxy(`${host}:${port}`)
    try {
      const ws = await attacker(child.port, loginProtocols())
      await new Promise((r) => setTimeout(r, 200)) // (the login's answer is in)
      const cpu = child.cpuSeconds()
      const started = performance.now()
      await servedThroughout(child.port, async () => {
        // CopyData outside COPY, which Postgres ignores, then a Sync: its ReadyForQuery says the proxy has relayed it all.
        assert.ok(await within(20_000, 'the 16 MB message to be sent', sendCut(ws, 'd', 16 << 20, 2048)), 'the proxy took it all')
        await within(20_000, 'the ReadyForQuery behind the 16 MB message', ask(ws, sync))
      })
      const spent = child.cpuSeconds() - cpu
      t.diagnostic(`16 MB in 2 KB frames: ${spent.toFixed(2)} s of the proxy's CPU, ${((performance.now() - started) / 1000).toFixed(1)} s in all`)
      assert.ok(spent < 2, `the proxy spent ${spent.toFixed(2)} s of CPU`)
      ws.close()
    } finally {
      await child.stop()
    }
  })

  test('512 MiB in 4 MiB WebSocket messages, 32 MiB protocol messages from 16 sessions: held within --max-client-buffer, counted in client_buffer_bytes, refused past it (1009), given back', async (t) => {
    const BUDGET = 96 * MiB
    const LIMIT = 48 * MiB
    const child = await startGcProxy(`${host}:${port}`, ['--max-client-buffer', String(BUDGET), '--max-message-bytes', String(LIMIT)], { MALLOC_MMAP_THRESHOLD_: '65536' })
    const before = await child.memoryAfterGc()
    let peak = child.rss()
    try {
      const ended = child.logs.length
      const sampler = setInterval(() => (peak = Math.max(peak, child.rss())), 50)
      let held = 0
      let codes: number[] = []
      let tooLarge = { code: 0, reason: '' }
      await servedThroughout(child.port, async () => {
        try {
          // One message of 40 MiB, all but its last byte sent: counted while it is held.
          const holder = await attacker(child.port, loginProtocols())
          assert.ok(await sendCut(holder, 'd', 40 * MiB, 4 * MiB, true), 'the 40 MiB went')
          await eventually(async () => (held = await bufferBytes(child.port)) >= 40 * MiB, 'the message under way to be counted', 5000).catch(() => {})
          // 16 sessions, each 32 MiB of a message: those the budget has no room for are closed.
          const sockets = await Promise.all(Array.from({ length: 16 }, () => attacker(child.port, loginProtocols())))
          const closes = sockets.map(closing)
          await Promise.all(sockets.map((ws) => within(30_000, 'a 32 MiB message to be sent or refused', sendCut(ws, 'd', 32 * MiB, 4 * MiB, true))))
          await new Promise((r) => setTimeout(r, 300))
          // One over --max-message-bytes is refused at its header.
          const large = await attacker(child.port, loginProtocols())
          const largeClosed = closing(large)
          large.send(header('d', 64 * MiB))
          tooLarge = await within(2000, 'a message over --max-message-bytes to be refused at its header', largeClosed).catch(() => tooLarge)
          for (const ws of [holder, ...sockets, large]) ws.terminate()
          codes = (await Promise.all(closes)).map((c) => c.code)
        } finally {
          clearInterval(sampler)
        }
      })
      peak = Math.max(peak, child.rss())
      await eventually(() => child.logs.length >= ended + 19, 'every session to end')
      await eventually(async () => (await bufferBytes(child.port)) === 0, 'client_buffer_bytes back to 0')
      const growth = { peak: (peak - before.rss) / MiB, ...(await givenBack(child, before)) }
      t.diagnostic(`RSS grew by ${growth.peak.toFixed(1)} MiB at the peak, ${growth.after.toFixed(1)} MiB once the sessions had gone (Buffers ${growth.buffers.toFixed(1)} MiB); client_buffer_bytes ${held} while held; closed with ${codes}`)
      assert.ok(held >= 40 * MiB && held <= BUDGET, `client_buffer_bytes ${held} while a 40 MiB message is held`)
      assert.equal(tooLarge.code, 1009, 'a message over --max-message-bytes refused at its header')
      assert.match(tooLarge.reason, /over --max-message-bytes/)
      // (A client still sending may miss the close frame: the connection is cut 100 ms after it, and the reset can overtake it.)
      const shed = child.logs.slice(ended).filter((l) => l.kind === 'over_budget').length
      assert.ok(shed >= 16 - Math.floor((BUDGET - 40 * MiB) / (32 * MiB)), `closed over the budget: ${shed} of 16 (codes ${codes})`)
      assert.ok(growth.peak <= BUDGET / MiB + 64, `the proxy grew by ${growth.peak.toFixed(1)} MiB (budget ${BUDGET / MiB} MiB)`)
      assert.ok(growth.buffers < 8, `Buffers ${growth.buffers.toFixed(1)} MiB above where they were once the sessions had gone`)
      // (What glibc keeps of the reads the messages came in varies: at most half of what was held stays.)
      assert.ok(growth.after < BUDGET / MiB / 2, `RSS ${growth.after.toFixed(1)} MiB above where it was once the sessions had gone (${growth.heap})`)
    } finally {
      t.diagnostic(`RSS peak ${((peak - before.rss) / MiB).toFixed(1)} MiB above where it was`)
      await child.stop()
    }
  })

  test('the wait for a backend is bounded: messages queued meanwhile are counted, and past --max-message-bytes the session is closed (1009); the proxy goes on', async (t) => {
    const CAP = 8 * MiB
    const child = await startChildProxy(`${host}:${port}`, { flags: ['--pool-size', '1', '--pool-timeout', '30000', '--max-message-bytes', String(CAP)] })
    // Sessions of one login (one pool key), the first holding the one backend in a transaction.
    const holder = await attacker(child.port, loginProtocols())
    try {
      await new Promise((r) => setTimeout(r, 200)) // (the login's answer is in)
      await within(5000, 'BEGIN', ask(holder, queryMessage('BEGIN')))
      const ws = await attacker(child.port, loginProtocols())
      const closed = closing(ws)
      // 1 MiB queries, one a WebSocket message, while it waits: counted as they queue.
      const query = queryMessage(`SELECT 1 -- ${'x'.repeat(MiB - 20)}`)
      for (let i = 0; i < 4; i++) ws.send(query)
      let held = 0
      await eventually(async () => (held = await bufferBytes(child.port)) >= 4 * MiB, 'the queued messages to be counted', 5000).catch(() => {})
      assert.ok(held >= 4 * MiB, `client_buffer_bytes ${held} with 4 MiB queued`)
      for (let sent = 4; sent < 64 && ws.readyState === ws.OPEN; sent++) await new Promise((r) => ws.send(query, r))
      const { code, reason } = await within(5000, 'the session to be closed past the cap', closed)
      await eventually(() => child.logs.some((l) => l.kind === 'client_error'), 'the session to end')
      const { bytesIn, outcome } = child.logs.find((l) => l.kind === 'client_error')!
      t.diagnostic(`closed after ${(Number(bytesIn) / MiB).toFixed(1)} MiB read: ${code} ${reason} (${outcome})`)
      assert.equal(code, 1009)
      assert.match(reason, /waiting for a backend over --max-message-bytes/)
      assert.ok(Number(bytesIn) <= CAP + 2 * MiB, `closed after ${bytesIn} bytes read`)
      await eventually(async () => (await bufferBytes(child.port)) === 0, 'client_buffer_bytes back to 0')
      // The proxy goes on: the transaction ends, and another session is served on that backend.
      await within(5000, 'COMMIT', ask(holder, queryMessage('COMMIT')))
      const other = await attacker(child.port, loginProtocols())
      await within(5000, 'a query once the backend is free', ask(other, queryMessage('SELECT 1')))
      other.close()
    } finally {
      holder.terminate()
      await child.stop()
    }
  })
})

// ── logins waiting on Postgres ──────────────────────────────────────────────────────────────

const ATTACKERS = ['127.0.0.2', '127.0.0.3', '127.0.0.4', '127.0.0.5', '127.0.0.6']
const LOGINS = 30
const LOGINS_PER_IP = 4

/**
 * The proxy's (in this process) connections to Postgres: how many it made, and how many are open
 * with no ReadyForQuery from Postgres yet (logins under way). The proxy connects with an options
 * object; the test's own pg clients pass (port, host), and are not counted.
 */
const atPostgres = { connects: 0, logins: 0 }
{
  const original = net.Socket.prototype.connect
  net.Socket.prototype.connect = function (this: net.Socket, ...args: any[]) {
    const options = Array.isArray(args[0]) ? args[0][0] : args[0]
    if (typeof options === 'object' && options !== null && String(options.port) === String(port)) {
      atPostgres.connects++
      atPostgres.logins++
      let pending = Buffer.alloc(0)
      let counted = true
      const done = () => {
        if (counted) atPostgres.logins--
        counted = false
        this.off('data', watch)
      }
      // Postgres's messages, framed, until ReadyForQuery.
      const watch = (chunk: Buffer) => {
        pending = Buffer.concat([pending, chunk])
        while (pending.length >= 5 && pending.length >= 1 + pending.readInt32BE(1)) {
          if (pending[0] === 0x5a) return done()
          pending = pending.subarray(1 + pending.readInt32BE(1))
        }
      }
      this.on('data', watch)
      this.once('close', done)
    }
    return original.apply(this, args as any)
  } as typeof original
  after(() => void (net.Socket.prototype.connect = original))
}

/** A StartupMessage for a real role, and never the password (nor anything else) Postgres asks for. */
const noPassword = () => startupMessage({ user, database, application_name: 'edgepg-attack' })

describe('logins waiting on Postgres', { concurrency: false }, () => {
  /**
   * `perAddress` logins from each attacking address, sent `how`, held open; meanwhile five fresh
   * logins from 127.0.0.1 (a new application_name each: no warm backend serves them). Returns the
   * most logins the proxy had at Postgres at once during the attack.
   */
  async function underAttack(proxyPort: number, perAddress: number, how: 'upgrade' | 'in band') {
    // (Logins of the test before, still on their way to Postgres as its proxy closed, are not this one's.)
    await eventually(() => atPostgres.logins === 0, 'logins of earlier tests to be gone', 10_000)
    let peak = 0
    const sampler = setInterval(() => (peak = Math.max(peak, atPostgres.logins)), 10)
    const sockets: WebSocket[] = []
    try {
      await Promise.all(
        ATTACKERS.flatMap((address) =>
          Array.from({ length: perAddress }, async () => {
            const ws = await attacker(proxyPort, how === 'upgrade' ? [SUBPROTOCOL, LOGIN_PREFIX + noPassword().toString('base64url')] : undefined, address).catch(() => undefined)
            if (!ws) return
            sockets.push(ws)
            if (how === 'in band') ws.send(noPassword())
          })
        )
      )
      await new Promise((r) => setTimeout(r, 300)) // the logins are at Postgres, or waiting their turn
      for (let i = 0; i < 5; i++) {
        const client = edgeClient(proxyPort, 'scram_user', { application_name: `edgepg-legit-${i}` })
        const started = performance.now()
        await within(2000, `legitimate login ${i + 1} under attack`, client.connect())
        assert.deepEqual((await client.query('SELECT 1 AS one')).rows, [{ one: 1 }])
        const took = performance.now() - started
        await client.end()
        assert.ok(took < 2000, `legitimate login ${i + 1} took ${Math.round(took)} ms`)
      }
      return peak
    } finally {
      clearInterval(sampler)
      for (const ws of sockets) ws.terminate()
    }
  }

  test('--handshake-timeout runs until Postgres has accepted the login, not until the startup was forwarded', async () => {
    for (const [how, authOffload] of [['upgrade', true], ['in band', false]] as const) {
      const p = await startProxy({ handshakeTimeoutMs: 500, authOffload })
      try {
        const started = performance.now()
        const ws = new WebSocket(p.url, how === 'upgrade' ? [SUBPROTOCOL, LOGIN_PREFIX + noPassword().toString('base64url')] : undefined, { localAddress: '127.0.0.2' })
        const asked = new Promise<Buffer>((r) => ws.once('message', r))
        const closed = new Promise<number>((r) => ws.once('close', r))
        if (how === 'in band') ws.once('open', () => ws.send(noPassword()))
        assert.equal((await within(2000, 'Postgres to ask for SCRAM', asked))[0], 0x52, `${how}: Postgres asks the client to authenticate`)
        assert.equal(await within(3000, 'the proxy to close the stalled login', closed), 1008, how)
        const took = performance.now() - started
        assert.ok(took >= 450 && took < 2000, `${how}: closed ${Math.round(took)} ms after it began (handshake timeout 500 ms)`)
        await eventually(() => atPostgres.logins === 0, 'its connection to Postgres to be closed')
      } finally {
        await p.close()
      }
    }
  })

  const limits = { maxLogins: LOGINS, maxLoginsPerIp: LOGINS_PER_IP, maxSessionsPerIp: 200, handshakeTimeoutMs: 2000 }

  test(`450 password-less logins in the upgrade from five addresses: Postgres holds at most ${ATTACKERS.length} × ${LOGINS_PER_IP} for them, and a legitimate login connects at once`, async () => {
    // (Session mode: in transaction mode a key's logins wait for its first, so fewer reach the gate.)
    const p = await startProxy({ ...limits, pool: { mode: 'session' } })
    try {
      const peak = await underAttack(p.port, 90, 'upgrade')
      // The attack's, plus the one legitimate login at a time.
      assert.ok(peak <= ATTACKERS.length * LOGINS_PER_IP + 1, `the proxy had ${peak} logins at Postgres at once`)
      assert.ok(peak >= ATTACKERS.length * LOGINS_PER_IP, `the attack did reach Postgres, as far as the limits let it (${peak})`)
      await eventually(() => p.sessionCount === 0, 'every attacking session to end', 5000)
    } finally {
      await p.close()
    }
  })

  test('SCRAM end to end (no auth offload), in band: the same bound', async () => {
    const p = await startProxy({ ...limits, authOffload: false })
    try {
      const peak = await underAttack(p.port, 30, 'in band')
      assert.ok(peak <= ATTACKERS.length * LOGINS_PER_IP + 1, `the proxy had ${peak} logins at Postgres at once`)
      assert.ok(peak >= ATTACKERS.length * LOGINS_PER_IP, `the attack did reach Postgres, as far as the limits let it (${peak})`)
    } finally {
      await p.close()
    }
  })

  test("the in-band startup Neon's driver sends, with auth offload: no Postgres connection before the password", async () => {
    const p = await startProxy(limits)
    try {
      const peak = await underAttack(p.port, 30, 'in band')
      assert.ok(peak <= 1, `the proxy had ${peak} logins at Postgres (only the legitimate one's)`)
    } finally {
      await p.close()
    }
  })
})

// ── cancel requests ─────────────────────────────────────────────────────────────────────────

const cancelRequest = (pid: number, secret: number) => {
  const packet = Buffer.alloc(16)
  packet.writeInt32BE(16, 0)
  packet.writeInt32BE(80877102, 4)
  packet.writeInt32BE(pid, 8)
  packet.writeInt32BE(secret, 12)
  return packet
}

/** A CancelRequest from `address`, in the upgrade or in band; resolves once the proxy has closed the session. */
async function sendCancel(proxyPort: number, packet: Buffer, address: string, inUpgrade: boolean) {
  const ws = await attacker(proxyPort, inUpgrade ? [SUBPROTOCOL, LOGIN_PREFIX + packet.toString('base64url')] : undefined, address)
  const closed = new Promise((r) => ws.once('close', r))
  if (!inUpgrade) ws.send(packet)
  await within(5000, 'the proxy to close a cancel session', closed)
}

describe('cancel requests', { concurrency: false }, () => {
  test('1,000 CancelRequests with keys the proxy never issued reach nothing; one naming a running session stops it', async () => {
    const p = await startProxy({ maxCancelsPerIp: 1e6, pool: { enabled: false } })
    const client = edgeClient(p.port, 'scram_user', { application_name: 'edgepg-cancel-target' })
    await client.connect()
    try {
      const { processID, secretKey } = client as unknown as { processID: number; secretKey: number }
      const before = atPostgres.connects
      for (let batch = 0; batch < 10; batch++) {
        await Promise.all(
          Array.from({ length: 100 }, (_, i) => {
            const pid = (Math.random() * 2 ** 31) | 0
            return sendCancel(p.port, cancelRequest(pid === processID ? pid + 1 : pid, (Math.random() * 2 ** 31) | 0), ATTACKERS[i % 5], i % 2 === 0)
          })
        )
      }
      // The right process with a wrong secret is no key either.
      await sendCancel(p.port, cancelRequest(processID, secretKey ^ 1), '127.0.0.2', true)
      assert.equal(atPostgres.connects - before, 0, 'no CancelRequest with a made-up key made the proxy connect to Postgres')

      const running = client.query('SELECT pg_sleep(30)').then(
        () => assert.fail('pg_sleep(30) cannot finish here'),
        (err: Error & { code?: string }) => err
      )
      await new Promise((r) => setTimeout(r, 200))
      await sendCancel(p.port, cancelRequest(processID, secretKey), '127.0.0.2', true)
      assert.equal((await within(5000, 'the cancel to stop the statement', running)).code, '57014')
      assert.equal(atPostgres.connects - before, 1, 'the one real cancel reached Postgres')
    } finally {
      await client.end()
      await p.close()
    }
  })

  test('cancels are limited per address, known key or not: at most --max-cancels-per-ip a second reach Postgres', async () => {
    const LIMIT = 5
    const p = await startProxy({ maxCancelsPerIp: LIMIT, pool: { enabled: false } })
    const client = edgeClient(p.port, 'scram_user', { application_name: 'edgepg-cancel-idle' })
    await client.connect()
    try {
      const { processID, secretKey } = client as unknown as { processID: number; secretKey: number }
      const packet = cancelRequest(processID, secretKey) // for an idle session: Postgres does nothing
      const before = atPostgres.connects
      const started = Date.now()
      await Promise.all(Array.from({ length: 40 }, (_, i) => sendCancel(p.port, packet, '127.0.0.2', i % 2 === 0)))
      const seconds = Math.floor(Date.now() / 1000) - Math.floor(started / 1000) + 1
      const forwarded = atPostgres.connects - before
      assert.ok(forwarded >= LIMIT && forwarded <= LIMIT * seconds, `${forwarded} of 40 reached Postgres over ${seconds} clock second(s)`)
      // Another address has its own allowance.
      await sendCancel(p.port, packet, '127.0.0.3', true)
      assert.equal(atPostgres.connects - before, forwarded + 1, 'a cancel from another address still reaches Postgres')
      assert.deepEqual((await client.query('SELECT 1 AS one')).rows, [{ one: 1 }])
    } finally {
      await client.end()
      await p.close()
    }
  })
})

test('with TLS inside the socket the proxy cannot see keys: while such a session is open to an upstream, a cancel it cannot place goes on', () => {
  const cancels = new Cancels(new BackendPool(), 1e6)
  const packet = cancelRequest(1234, 5678)
  const route = (upstream: string) => Object.keys(cancels.route(upstream, packet, '127.0.0.2'))[0]
  assert.equal(route('db:5432'), 'refused')
  const forget = cancels.issue('db:5432', { pid: 1234, secret: packet.subarray(12) })
  assert.equal(route('db:5432'), 'packet', 'a key the proxy saw go by')
  forget()
  assert.equal(route('db:5432'), 'refused', 'not once its session has ended')
  const unhide = cancels.hide('db:5432')
  assert.equal(route('db:5432'), 'packet', 'perhaps the TLS session\'s')
  assert.equal(route('other:5432'), 'refused', 'only for the upstream that session is on')
  unhide()
  assert.equal(route('db:5432'), 'refused')
})

test('/sql bodies count against --max-client-buffer: one that does not fit gets 503, the next small one is served', async () => {
  const p = await startProxy({ maxClientBufferBytes: 1 << 20 })
  try {
    const send = (body: string) =>
      fetch(`http://127.0.0.1:${p.port}/sql`, { method: 'POST', headers: { 'Neon-Connection-String': connectionString }, body }).then(async (r) => ({ status: r.status, body: await r.json() }))
    const large = await send(JSON.stringify({ query: 'SELECT length($1) AS n', params: ['x'.repeat(2 << 20)] }))
    assert.equal(large.status, 503)
    assert.match(large.body.message, /over its memory budget for request bodies \(--max-client-buffer\)/)
    const small = await send(JSON.stringify({ query: 'SELECT length($1) AS n', params: ['x'.repeat(1000)] }))
    assert.equal(small.status, 200, JSON.stringify(small.body))
    assert.deepEqual(small.body.rows, [{ n: 1000 }])
  } finally {
    await p.close()
  }
})

// ── keys that crowd the pool ─────────────────────────────────────────────────────────────────

describe('a client that varies its startup parameters (a pool key each)', { concurrency: false }, () => {
  /** A WebSocket from the attacker's address. */
  class FromAttacker extends WebSocket {
    constructor(url: string, protocols?: string | string[]) {
      super(url, protocols, { localAddress: '127.0.0.2' })
    }
  }
  const IDLE_MS = 200
  const keysProxy = (pool: object) => startProxy({ pool: { mode: 'transaction', idleTimeoutMs: IDLE_MS, timeoutMs: 2000, ...pool } })
  /** `n` logins from 127.0.0.2, each with an application_name of its own, each running SELECT 1 and leaving (five at a time). */
  async function varyKeys(port: number, n: number) {
    for (let i = 0; i < n; i += 5) {
      await Promise.all(Array.from({ length: Math.min(5, n - i) }, async (_, j) => {
        const c = edgeClient(port, 'scram_user', { webSocketConstructor: FromAttacker as any, application_name: `crowd-${i + j}` } as any)
        await c.connect()
        await c.query('SELECT 1')
        await c.end()
      }))
    }
  }
  const crowd = async () => {
    const c = new pg.Client(pgConfig('scram_user'))
    await c.connect()
    try {
      return Number((await c.query(`SELECT count(*) AS n FROM pg_stat_activity WHERE application_name LIKE 'crowd-%'`)).rows[0].n)
    } finally {
      await c.end()
    }
  }

  const keptNames = async () => {
    const c = new pg.Client(pgConfig('scram_user'))
    await c.connect()
    try {
      return (await c.query(`SELECT application_name AS a FROM pg_stat_activity WHERE application_name LIKE 'crowd-%'`)).rows.map((r) => r.a as string)
    } finally {
      await c.end()
    }
  }

  test('keys one client keeps warm past the idle timeout: at most its share (--max-backends-per-client), those it used last', async () => {
    const p = await keysProxy({ maxPerClient: 3 })
    try {
      await varyKeys(p.port, 12)
      await eventually(async () => (await crowd()) <= 3, 'the client to keep at most 3 keys warm', 5000, 100)
      await new Promise((r) => setTimeout(r, IDLE_MS * 3)) // (the share is kept, not emptied)
      const kept = await keptNames()
      assert.equal(kept.length, 3, `kept: ${kept}`)
      // The last five logins ran after the others: the two of the last round, and one of the round before.
      assert.ok(kept.includes('crowd-10') && kept.includes('crowd-11') && kept.every((a) => Number(a.slice(6)) >= 5), `kept: ${kept}`)
    } finally {
      await p.close()
    }
  })

  test('while every backend of the pool is lent, a client gets at most its share of connections of its own to Postgres (--max-backends-per-client); another client gets its own', async () => {
    const p = await keysProxy({ maxBackends: 3, maxPerClient: 2 })
    const clients: Client[] = []
    const open = async (app: string, from: 'attacker' | 'other' = 'attacker') => {
      const c = edgeClient(p.port, 'scram_user', { application_name: app, ...(from === 'attacker' && { webSocketConstructor: FromAttacker as any }) } as any)
      clients.push(c)
      return c.connect().then(() => c, (err: Error & { code?: string }) => err)
    }
    try {
      // Three keys' sessions hold the pool's three backends (a statement running on each).
      const busy = await Promise.all(['crowd-busy-0', 'crowd-busy-1', 'crowd-busy-2'].map((app) => open(app)))
      const running = busy.map((c) => (c as Client).query('SELECT pg_sleep(3)').then(() => 'ran', (err: Error) => err.message))
      await eventually(async () => (await crowd()) === 3 && (await keptNames()).length === 3, 'the three to run', 5000, 50)
      const outside = [await open('crowd-out-0'), await open('crowd-out-1'), await open('crowd-out-2')]
      assert.ok(outside[0] instanceof Client && outside[1] instanceof Client, `${outside.slice(0, 2)}`)
      const refused = outside[2] as Error & { code?: string }
      assert.equal(refused.code, '53300', String(refused))
      assert.match(refused.message, /--max-backends-per-client/)
      assert.ok((await open('crowd-other', 'other')) instanceof Client, 'another client connects')
      assert.deepEqual(await Promise.all(running), ['ran', 'ran', 'ran'])
    } finally {
      await Promise.all(clients.map((c) => c.end().catch(() => {})))
      await p.close()
    }
  })

  test("kept keys fill the pool (--pool-max-backends): they give way, the least recently used first, to another user's concurrency and logins", async () => {
    const MAX = 16
    const p = await keysProxy({ maxBackends: MAX, maxPerClient: 20 })
    const errors: string[] = []
    const victim = (app = 'victim') => edgeClient(p.port, 'md5_user', { application_name: app } as any)
    try {
      const first = victim()
      await first.connect()
      await first.query('SELECT 1') // (its key's lender, with one backend)
      await first.end()
      await varyKeys(p.port, MAX)
      await eventually(async () => (await crowd()) >= MAX - 1, 'the crowd to keep its backends', 5000, 100)
      await new Promise((r) => setTimeout(r, IDLE_MS * 2)) // (past the idle timeout: kept warm)
      assert.ok((await crowd()) >= MAX - 1, 'the crowd keeps the pool full')
      // Twelve sessions of another user at once, each 0.3 s (one backend in turn would take 3.6 s: past --pool-timeout); then a login of a key of its own.
      await Promise.all(Array.from({ length: 12 }, async () => {
        const c = victim()
        await c.connect()
        await c.query('SELECT pg_sleep(0.3)').catch((err: Error & { code?: string }) => errors.push(`${err.code}: ${err.message}`))
        await c.end()
      }))
      const other = victim('victim-2')
      await other.connect()
      assert.equal((await other.query('SELECT 2 AS n')).rows[0].n, 2)
      await other.end()
      assert.deepEqual(errors, [])
      const kept = await crowd()
      assert.ok(kept <= MAX - 12, `the crowd still keeps ${kept} of ${MAX}`)
      const pooled = Number((await p.metrics!.registry.metrics()).match(/^edgepg_proxy_pool_backends (\d+)/m)![1])
      assert.ok(pooled <= MAX, `the pool owns ${pooled} backends, over --pool-max-backends ${MAX}`)
    } finally {
      await p.close()
    }
  })
})
