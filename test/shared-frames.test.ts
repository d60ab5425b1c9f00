import { test } from 'node:test'
import assert from 'node:assert/strict'
import { once } from 'node:events'
import { WebSocket, WebSocketServer } from 'ws'
import { sendShared } from '../proxy/ws/shared-frames'

test('sendShared: one Buffer to several WebSockets, each framing size, arrives whole and in order with ws.send; nothing is written once closing', async () => {
  const wss = new WebSocketServer({ port: 0, host: '127.0.0.1', perMessageDeflate: false })
  await once(wss, 'listening')
  const { port } = wss.address() as { port: number }
  const sizes = [0, 1, 125, 126, 65535, 65536, 70000]
  const payloads = sizes.map((n, i) => Buffer.alloc(n, i + 1))
  try {
    const clients = [new WebSocket(`ws://127.0.0.1:${port}`), new WebSocket(`ws://127.0.0.1:${port}`)]
    const received = clients.map((c) => {
      const got: Buffer[] = []
      c.on('message', (data) => got.push(data as Buffer))
      return got
    })
    const servers: WebSocket[] = []
    wss.on('connection', (ws) => servers.push(ws))
    await Promise.all(clients.map((c) => once(c, 'open')))
    while (servers.length < 2) await once(wss, 'connection')
    // (Interleaved with ws's own sends: a direct write must not pass one.)
    for (const p of payloads) for (const ws of servers) ws.send(Buffer.from('ws')), sendShared(ws, p)
    const expected = payloads.flatMap((p) => [Buffer.from('ws'), p])
    for (let waited = 0; received.some((r) => r.length < expected.length) && waited < 5000; waited += 20) await new Promise((r) => setTimeout(r, 20))
    for (const got of received) assert.deepEqual(got, expected)
    // A closing WebSocket: the send goes to ws, which writes nothing after its close frame.
    servers[0].close()
    const socket = (servers[0] as unknown as { _socket: { write: (...a: unknown[]) => boolean } })._socket
    const write = socket.write
    let writes = 0
    socket.write = (...a) => (writes++, write.apply(socket, a))
    sendShared(servers[0], payloads[1])
    assert.equal(writes, 0, 'nothing written after the close frame')
    for (const c of clients) c.close()
  } finally {
    wss.close()
  }
})
