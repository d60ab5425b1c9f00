/**
 * The WebSocket socket behaves as the net.Socket pg and pg-pool drive: 'end' when the other side
 * closes, ref()/unref() that let Node exit (pg-pool's allowExitOnIdle), and a connect() after a
 * destroy() that came first (pg-pool's connection timeout). node-postgres's pg-pool suite needs
 * each of them; these are our own tests of the same behaviour.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import type { AddressInfo } from 'node:net'
import { WebSocket, WebSocketServer } from 'ws'
import { WebSocketSocket } from '../src/socket'
import { startProxy, edgeConfig, within } from './support/helpers'

let wss: WebSocketServer
let url: string
before(async () => {
  wss = new WebSocketServer({ port: 0, host: '127.0.0.1' })
  // A peer that closes (code 1000) when told to, and answers the close handshake.
  wss.on('connection', (ws) => ws.on('message', (data) => String(data) === 'bye' && ws.close(1000)))
  await new Promise((r) => wss.once('listening', r))
  url = `ws://127.0.0.1:${(wss.address() as AddressInfo).port}/v2`
})
after(() => new Promise<void>((r) => wss.close(() => r())))

const socket = () => new WebSocketSocket({ webSocketConstructor: WebSocket as any, wsProxy: () => url })
const events = (s: WebSocketSocket) => {
  const seen: string[] = []
  for (const e of ['end', 'close', 'error']) s.on(e, () => seen.push(e))
  return seen
}

test("'end' then 'close' when the other side closes, and when our own end() completes the close handshake", async () => {
  const closedByPeer = socket()
  const seen = events(closedByPeer)
  await new Promise((r) => closedByPeer.connect(5432, 'db').once('connect', r))
  closedByPeer.write(Buffer.from('bye'))
  await within(5000, 'close', new Promise((r) => closedByPeer.once('close', r)))
  assert.deepEqual(seen, ['end', 'close'])

  const endedByUs = socket()
  const ours = events(endedByUs)
  await new Promise((r) => endedByUs.connect(5432, 'db').once('connect', r))
  endedByUs.end()
  await within(5000, 'close', new Promise((r) => endedByUs.once('close', r)))
  assert.deepEqual(ours, ['end', 'close'])
})

test('a socket destroyed before it connected connects when asked again, as net.Socket does', async () => {
  const s = socket()
  s.deferOpen = true // as a Client's connect() has it: the login rides in the upgrade
  s.destroy()
  await within(5000, 'connect after destroy', new Promise((r) => s.connect(5432, 'db').once('connect', r)))
  s.destroy()
})

test("unref(): a Pool with allowExitOnIdle lets Node exit while its connection idles (the built package, in a child)", async () => {
  const proxy = await startProxy()
  try {
    const config = { ...edgeConfig(proxy.port), webSocketConstructor: undefined, wsProxy: undefined }
    const script = `
      import { WebSocket } from 'ws'
      import { Pool } from 'edgepg'
      const pool = new Pool({ ...${JSON.stringify(config)}, webSocketConstructor: WebSocket, wsProxy: () => 'ws://127.0.0.1:${proxy.port}/v2', allowExitOnIdle: true, idleTimeoutMillis: 60000 })
      const { rows } = await pool.query('SELECT 1 AS one')
      console.log(rows[0].one, pool.idleCount)`
    const child = spawn(process.execPath, ['--input-type=module', '-e', script], { cwd: process.cwd(), stdio: ['ignore', 'pipe', 'inherit'] })
    let out = ''
    child.stdout.on('data', (d) => (out += d))
    const start = Date.now()
    const code = await within(20_000, 'the child to exit by itself (idleTimeoutMillis is 60 s)', new Promise((r) => child.once('exit', r)))
    assert.equal(code, 0)
    assert.equal(out.trim(), '1 1', 'the query ran, and its connection was idle in the pool at exit')
    assert.ok(Date.now() - start < 20_000)
  } finally {
    await proxy.close()
  }
})
