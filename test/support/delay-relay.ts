import net from 'node:net'

/**
 * A TCP relay that holds every chunk, in each direction, for `oneWayMs` before passing it on, so
 * elapsed time divided by the RTT (2 × oneWayMs) counts network round trips. Order and
 * half-closes are delayed alike.
 */
export async function startDelayRelay(target: { host: string; port: number }, oneWayMs: number) {
  const sockets = new Set<net.Socket>()
  const pipe = (from: net.Socket, to: net.Socket) => {
    from.on('data', (chunk) => setTimeout(() => to.writable && to.write(chunk), oneWayMs))
    from.on('end', () => setTimeout(() => to.end(), oneWayMs))
    from.on('error', () => setTimeout(() => to.destroy(), oneWayMs))
    from.on('close', () => setTimeout(() => to.destroy(), oneWayMs + 1))
  }
  const server = net.createServer((client) => {
    client.setNoDelay(true)
    const upstream = net.connect({ ...target, noDelay: true })
    for (const s of [client, upstream]) sockets.add(s).size && s.once('close', () => sockets.delete(s))
    pipe(client, upstream)
    pipe(upstream, client)
  })
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  return {
    port: (server.address() as net.AddressInfo).port,
    rttMs: 2 * oneWayMs,
    /** Drops every connection under way, without a word to either side's application; new ones are relayed. */
    cut: () => {
      for (const s of sockets) s.destroy()
    },
    close: () =>
      new Promise<void>((resolve) => {
        for (const s of sockets) s.destroy()
        server.close(() => resolve())
      }),
  }
}
