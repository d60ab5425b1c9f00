import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { WebSocket } from 'ws'
import { edgeConfig, startProxy, backends, eventually, recordingWebSocket, tags } from './support/helpers'
import { startDelayRelay } from './support/delay-relay'
import { Client, Pool, type ClientConfig } from '../src/index'
import { WebSocketSocket } from '../src/socket'

let proxy: Awaited<ReturnType<typeof startProxy>>
const sessions: { outcome: string; bytesIn: number }[] = []
// Without warm backends: these tests watch each backend exit with its client (the pool's are test/pool.test.ts's).
before(async () => (proxy = await startProxy({ log: (s) => sessions.push(s), pool: { enabled: false } })))
after(() => proxy.close())

test('a parameterized query is one WebSocket message, with no timer', async () => {
  const { sent, Recording } = recordingWebSocket()
  const client = new Client(edgeConfig(proxy.port, 'trust_user', { webSocketConstructor: Recording as any }))
  await client.connect()
  await client.query('SELECT 1') // the pipelined startup flight is sent
  const realSetTimeout = globalThis.setTimeout
  let timers = 0
  globalThis.setTimeout = ((...args: Parameters<typeof setTimeout>) => (timers++, realSetTimeout(...args))) as any
  try {
    sent.length = 0
    const { rows } = await client.query('SELECT $1::int + $2::int AS sum', [40, 2])
    assert.deepEqual(rows, [{ sum: 42 }])
    assert.equal(sent.length, 1, 'one message per query')
    assert.equal(tags(sent[0]), 'PBDES', 'Parse, Bind, Describe, Execute, Sync together')
  } finally {
    globalThis.setTimeout = realSetTimeout
  }
  assert.equal(timers, 0, 'no setTimeout on the query path')
  await client.end()
})

test('writes in one tick are one message; coalesceWrites: false sends each at once; cork batches either way', async () => {
  const { WebSocketServer } = await import('ws')
  const received: string[] = []
  const wss = new WebSocketServer({ port: 0, host: '127.0.0.1' })
  wss.on('connection', (ws) => ws.on('message', (data) => received.push(String(data))))
  await new Promise((r) => wss.once('listening', r))
  const url = `ws://127.0.0.1:${(wss.address() as import('node:net').AddressInfo).port}/v2`
  const open = async (coalesceWrites: boolean) => {
    const socket = new WebSocketSocket({ webSocketConstructor: WebSocket as any, wsProxy: () => url, coalesceWrites })
    await new Promise((r) => socket.connect(5432, 'db').once('connect', r))
    return socket
  }
  const expect = async (n: number) => eventually(() => received.length === n, `${n} messages`)
  try {
    const coalescing = await open(true)
    coalescing.write(Buffer.from('a'))
    coalescing.write(Buffer.from('b'))
    await expect(1)
    const direct = await open(false)
    direct.write(Buffer.from('c'))
    direct.write(Buffer.from('d'))
    await expect(3)
    direct.cork()
    direct.write(Buffer.from('e'))
    direct.write(Buffer.from('f'))
    direct.uncork()
    await expect(4)
    assert.deepEqual(received, ['ab', 'c', 'd', 'ef'])
    coalescing.end()
    direct.end()
  } finally {
    for (const c of wss.clients) c.terminate()
    wss.close()
  }
})

test('client.end() sends Terminate, closes the WebSocket itself, and resolves within one round trip', async () => {
  const relay = await startDelayRelay({ host: '127.0.0.1', port: proxy.port }, 100)
  const { sent, Recording } = recordingWebSocket()
  const config: ClientConfig = { ...edgeConfig(proxy.port, 'trust_user'), application_name: 'edgepg-end', webSocketConstructor: Recording as any, wsProxy: () => `ws://127.0.0.1:${relay.port}/v2` }
  const before = process.getActiveResourcesInfo().filter((r) => r !== 'TTYWrap').sort()
  const client = new Client(config)
  await client.connect()
  await client.query('SELECT 1')
  const started = Date.now()
  await client.end()
  const elapsed = Date.now() - started
  assert.equal(tags(sent.at(-1)!), 'X', 'Terminate is the last message')
  assert.ok(elapsed >= relay.rttMs * 0.9 && elapsed < relay.rttMs * 1.9, `end() took ${elapsed} ms; RTT is ${relay.rttMs} ms`)
  await eventually(() => sessions.some((s) => s.outcome === 'closed by client'), 'the proxy to log a client-closed session')
  await eventually(async () => (await backends('edgepg-end')) === 0, 'the backend to exit')
  // The relay still holds its own sockets; everything the client opened is gone.
  await relay.close()
  await eventually(() => {
    const now = process.getActiveResourcesInfo().filter((r) => r !== 'TTYWrap').sort()
    return now.filter((r) => r === 'TCPSocketWrap').length <= before.filter((r) => r === 'TCPSocketWrap').length && !now.includes('Timeout')
  }, 'no socket or timer left behind')
})

test('pool.end() closes every client and leaves no backend', async () => {
  const pool = new Pool({ ...edgeConfig(proxy.port), application_name: 'edgepg-pool-end', max: 5 })
  await Promise.all(Array.from({ length: 5 }, (_, i) => pool.query('SELECT pg_sleep(0.05), $1::int AS i', [i])))
  assert.equal(pool.totalCount, 5)
  assert.equal(await backends('edgepg-pool-end'), 5)
  await pool.end()
  assert.equal(pool.totalCount, 0)
  await eventually(async () => (await backends('edgepg-pool-end')) === 0, 'every pool backend to exit')
})

test('end() on a client that never connected resolves at once', async () => {
  await new Client(edgeConfig(proxy.port)).end()
})
