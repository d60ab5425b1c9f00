/**
 * A worker of bench/pool-ways.ts: holds logged-in Postgres connections, runs `SELECT 1` on one, gives
 * one away (its socket, to the parent), takes one given, or logs one in anew, as the parent asks.
 */
import type { Socket } from 'node:net'
import pg from 'pg'

const url = process.argv[2]
const sockets = new Map<number, Socket>()
const SELECT_1 = Buffer.from('Q\0\0\0\x0dSELECT 1\0', 'latin1')

/** `SELECT 1` on `socket`, read to its ReadyForQuery (the last byte of the answer's last message). */
function selectOne(socket: Socket): Promise<void> {
  return new Promise((resolve) => {
    let got = Buffer.alloc(0)
    const onData = (chunk: Buffer) => {
      got = Buffer.concat([got, chunk])
      if (got.length >= 6 && got[got.length - 6] === 0x5a) socket.off('data', onData), resolve()
    }
    socket.on('data', onData)
    socket.write(SELECT_1)
  })
}

async function login(): Promise<Socket> {
  const client = new pg.Client(url)
  client.on('error', () => {}) // (its socket goes elsewhere, or is closed, under it)
  await client.connect()
  const socket = (client as any).connection.stream as Socket
  socket.removeAllListeners('data')
  return socket
}

process.on('message', async (m: { op: string; id: number }, handle?: Socket) => {
  if (m.op === 'login') sockets.set(m.id, await login())
  else if (m.op === 'run') await selectOne(sockets.get(m.id)!)
  else if (m.op === 'take') sockets.set(m.id, handle!), await selectOne(handle!)
  else if (m.op === 'relogin') {
    sockets.get(m.id)?.end()
    sockets.set(m.id, await login())
    await selectOne(sockets.get(m.id)!)
  } else if (m.op === 'give') {
    const socket = sockets.get(m.id)!
    sockets.delete(m.id)
    return void process.send!({ op: 'given', id: m.id }, socket)
  } else if (m.op === 'cpu') return void process.send!({ op: 'cpu', cpu: process.cpuUsage() })
  else if (m.op === 'end') return void (sockets.forEach((s) => s.end()), process.disconnect())
  process.send!({ op: 'done', id: m.id })
})
process.send!({ op: 'ready' })
