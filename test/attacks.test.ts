/**
 * edgepg-proxy faces the internet: what a client without credentials can make it hold is bounded,
 * and freed within a known time, while a legitimate client is served. Against the real proxy and
 * Postgres; an attacker connects from 127.0.0.2, the legitimate client from 127.0.0.1.
 * - POST /sql: bodies that never finish hold a slot only until the read timeout, and at most
 *   `maxRequestsPerIp` at once from one address; odd requests (a doubled connection string, too
 *   many params, JSON nested past the stack) get a 400 that says what is wrong and echoes no secret.
 * - A WebSocket that never answers the proxy's close frame is cut a second later.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import net from 'node:net'
import { startProxy, pgConfig, within, eventually } from './helpers'

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
