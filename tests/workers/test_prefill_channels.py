"""The decode worker's channels to prefill workers: shared per address while in use, and closed
once idle, so prefill workers that came and went (scaling, restarts on new ports) leave none."""
import asyncio

import grpc

from decode_worker.server import PrefillChannels


async def test_channels_are_shared_per_address_and_idle_ones_closed():
    channels = PrefillChannels(idle_close_s=0.0)
    async with channels.use("127.0.0.1:1") as first:
        async with channels.use("127.0.0.1:1") as again:
            assert again is first  # one channel per address
        # a call in flight keeps its channel even when it is past the idle limit
        async with channels.use("127.0.0.1:2"):
            assert len(channels) == 2
    async with channels.use("127.0.0.1:3"):
        assert len(channels) == 1  # 1 and 2 were idle: closed as the next call started
    assert first.get_state() == grpc.ChannelConnectivity.SHUTDOWN
    await channels.close()
    assert len(channels) == 0


async def test_recently_used_channels_stay_open():
    channels = PrefillChannels(idle_close_s=3600.0)
    for port in (1, 2, 3):
        async with channels.use(f"127.0.0.1:{port}"):
            pass
    assert len(channels) == 3
    await channels.close()



class _SlowClosingChannel:
    def __init__(self, address, options):
        self.closed = 0

    async def close(self):
        self.closed += 1
        await asyncio.sleep(0.01)  # a close that yields, as one with calls to cancel does


async def test_concurrent_sweeps_close_each_channel_once(monkeypatch):
    monkeypatch.setattr(grpc.aio, "insecure_channel", _SlowClosingChannel)
    channels = PrefillChannels(idle_close_s=3600.0)
    opened = []
    for port in (1, 2, 3):
        async with channels.use(f"127.0.0.1:{port}") as channel:
            opened.append(channel)
    channels.idle_close_s = 0.0  # all three idle now

    async def call(port):
        async with channels.use(f"127.0.0.1:{port}"):
            await asyncio.sleep(0)

    await asyncio.gather(call(4), call(5))  # two sweeps at once, neither fails
    assert [channel.closed for channel in opened] == [1, 1, 1]
    await channels.close()
